"""runtime/quiet.py: the libraries' progress bars are off inside the block and each switch is put back after; the
CLI's --no-progress runs its verb inside that block."""

from __future__ import annotations

import diffusers.utils.logging as diffusers_logging
import huggingface_hub.utils as hub_utils
import pytest
import transformers.utils.logging as transformers_logging

from flowforge.runtime.quiet import library_progress_bars_off, quiet_library_fallbacks


def _switches() -> tuple[bool, bool, bool]:
    return (transformers_logging.is_progress_bar_enabled(), diffusers_logging.is_progress_bar_enabled(),
            not hub_utils.are_progress_bars_disabled())


@pytest.mark.parametrize("block", [library_progress_bars_off, quiet_library_fallbacks])
@pytest.mark.parametrize("before", [True, False])
def test_bars_off_inside_and_restored_after(block, before):
    for on, off in ((transformers_logging.enable_progress_bar, transformers_logging.disable_progress_bar),
                    (diffusers_logging.enable_progress_bar, diffusers_logging.disable_progress_bar),
                    (hub_utils.enable_progress_bars, hub_utils.disable_progress_bars)):
        (on if before else off)()
    try:
        with pytest.raises(RuntimeError):  # restored on an exception too
            with block():
                assert _switches() == (False, False, False)
                raise RuntimeError
        assert _switches() == (before,) * 3
    finally:
        transformers_logging.enable_progress_bar()
        diffusers_logging.enable_progress_bar()
        hub_utils.enable_progress_bars()


@pytest.mark.parametrize("flag", [True, False])
def test_no_progress_runs_the_verb_with_library_bars_off(monkeypatch, flag):
    from flowforge import cli

    seen = []
    monkeypatch.setattr(cli.VERBS["train"], "run", lambda args: seen.append(_switches()) or 0)
    assert cli.main(["train", "any.yaml", *(["--no-progress"] if flag else [])]) == 0
    assert seen == [(False,) * 3] if flag else seen == [_switches()]
    assert _switches() == (True,) * 3  # put back after the command
