"""``reward.options.vlm_judge``: the group judge's options, one typed and validated section
(:class:`~flowforge.rewards.options.ScorerOptions`).

A config gives them as a mapping (``reward.options.vlm_judge: {model: gpt-4o, base_url: ..., frames: 8}``; in a
pipeline config ``teacher.judge``, less the endpoint, ledger and budget the pipeline sets); preflight
(``flowforge check``) builds this section before any model loads, and
:class:`~flowforge.rewards.judge.client.VLMJudge` takes the built section. Each field's comment is its line in the
config reference and in the judge's table of ``docs/guides/rewards.md`` (both generated from this class).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowforge.rewards.judge.transport import RETRY_KINDS, UNBILLED_RETRIES
from flowforge.rewards.options import ScorerOptions
from flowforge.settings.schema import Checks

__all__ = ["JudgeOptions"]

JPEG_QUALITY = (1, 100)
"""The JPEG quality range (PIL clamps a value above 100 silently: refused instead)."""


@dataclass(frozen=True)
class JudgeOptions(ScorerOptions):
    """The options of the ``vlm_judge`` scorer (its endpoint, request settings, retries, ledger and budget)."""

    section_name = "reward.options.vlm_judge"
    choices = {"retry_on": RETRY_KINDS}

    model: str = ""  # required: the model id sent with every request
    base_url: str = ""  # required: the API root, e.g. http://127.0.0.1:8000/v1
    # environment variable holding the API key / bearer token; null: a placeholder (a server run with --no-auth)
    api_key_env: str | None = "OPENAI_API_KEY"
    timeout_s: float = 120.0  # seconds per HTTP request
    max_concurrency: int = 4  # groups in flight at once (and groups prepared on as many threads)
    template: str | None = None  # prompt template file, or a shipped one by name (group_v1/2/3); null: group_v2
    frames: int = 24  # frames sent per video candidate (an image is one frame)
    max_side: int = 832  # longest side of a sent frame, pixels
    max_attempts: int = 3  # billed HTTP attempts per group at most, over every run (first send, retries, repairs)
    # failed attempts sent again; the default retries only what cannot have been billed
    retry_on: tuple[str, ...] = UNBILLED_RETRIES
    retry_backoff_s: float = 1.0  # first back-off, seconds; doubled per retry
    seed: int = 0  # candidate permutation seed, also sent as the request's seed
    temperature: float = 0.0  # sampling temperature sent with each request (part of the request key)
    max_tokens: int = 512  # completion tokens per reply at most (part of the request key)
    jpeg_quality: int = 90  # JPEG quality of the sent frames (part of the request key through the frame hashes)
    reference_root: str | None = None  # where relative metadata reference / image paths are read; null: cwd
    # explicit ledger path (frames beside it in media/); null: RUN/judge/ledger.sqlite, in memory without a run
    ledger: str | None = None
    max_billed: int = 0  # budget: billed attempts the ledger may hold at most; 0: no limit
    paid: bool = True  # evaluation counts this judge as paid (eval.teacher_groups); false for a student

    def problems(self) -> list[str]:
        c = Checks(self)
        c.problems += super().problems()  # retry_on's items
        self.bound(c, "model", bool(self.model), "a non-empty model id")
        self.bound(c, "base_url", bool(self.base_url), "a non-empty API root (http(s)://host:port/v1)")
        self.bound(c, "timeout_s", self.timeout_s > 0, "a number > 0")
        for key, low in (("max_concurrency", 1), ("frames", 1), ("max_side", 1), ("max_attempts", 1),
                         ("max_tokens", 1), ("max_billed", 0)):
            self.bound(c, key, getattr(self, key) >= low, f"an int >= {low}")
        for key in ("retry_backoff_s", "temperature"):
            self.bound(c, key, getattr(self, key) >= 0, "a number >= 0")
        low, high = JPEG_QUALITY
        self.bound(c, "jpeg_quality", low <= self.jpeg_quality <= high, f"an int from {low} to {high}")
        return c.problems
