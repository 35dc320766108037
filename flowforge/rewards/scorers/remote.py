"""The ``remote`` scorer: reward components computed by a ``flowforge serve reward`` service over HTTP (``httpx``).

A reward whose dependencies or devices clash with training runs in another process or machine; this client sends it
the batch and reads back the scores. Wire format and routes: :mod:`flowforge.serve.reward_server`; media encoding:
:mod:`flowforge.rewards.wire` (lossless by default, so a deterministic scorer gives the same bits as in process).

The score of one sample is ``r = sum_c w_c * s_c`` over the requested server components ``c`` (``components``: a
list means every ``w_c = 1``; one component gives its score unchanged). A component the server scores ``null``
(NaN, "not applicable") makes ``r`` NaN.

Failures are never rewards:

* timeouts, connection errors, 429 and 5xx answers are retried ``retries`` times, waiting
  ``backoff * 2**attempt`` seconds (exponential backoff); a batch that still fails scores NaN, which the reward
  processor counts in ``reward/<name>_nan_fraction`` and turns into an error for a required component;
* any other 4xx (bad token, malformed payload, unknown component) is a configuration error and raises at once with
  the server's message.

Concurrency: ``max_concurrency`` calls may be in flight at once. The reward processor sends a step's
``reward.batch_size`` slices together, up to that many (:func:`flowforge.rewards.groups.call_many`); the scores land
in order, the same as one after another. The scorer is safe to call from several threads (``httpx.Client`` is).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.rewards.base import check_batch_size, check_inputs
from flowforge.rewards.wire import ENCODINGS, encode_images

log = logging.getLogger("flowforge")

TOKEN_ENV = "FLOWFORGE_REWARD_TOKEN"
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class RemoteScorerError(ValueError):
    """The reward service refused a request (a 4xx other than 429): its message says why."""


def _weights(components: Sequence[str] | Mapping[str, float] | None) -> dict[str, float] | None:
    if components is None:
        return None
    if isinstance(components, str):
        raise ValueError(f"components must be a list of names or a name -> weight mapping, got {components!r}")
    weights = dict(components) if isinstance(components, Mapping) else {c: 1.0 for c in components}
    if not weights:
        raise ValueError("components is empty: name at least one server component")
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"components[{name!r}] must be a finite number, got {weight!r}")
    return {str(k): float(v) for k, v in weights.items()}


class RemoteScorer:
    """Scores through a reward service.

    Args:
        url: the service's base URL, as ``flowforge serve reward`` prints it (``http://127.0.0.1:8765``).
        components: server components to request: a list (summed) or a name -> weight mapping; ``None`` = the
            server's only component (an error when it hosts several).
        token_env: name of the environment variable holding the bearer token (read when the scorer is built);
            ``None`` sends no token (a ``--no-auth`` server).
        timeout: seconds per HTTP request (connect + read), > 0.
        retries: extra attempts after a retryable failure, >= 0.
        backoff: first wait between attempts in seconds, doubled each time, >= 0.
        batch_size: samples per HTTP request, >= 1 (keep it within the server's ``max_batch``).
        encoding: ``"auto"`` (lossless: PNG where exact, else float32), ``"png"`` (smaller, rounds to 8 bits) or
            ``"float32"``.
        max_concurrency: calls in flight at once when the reward processor has several for one step, >= 1 (1: one
            after another). Keep it within what the service can take (``serve reward`` scores one request at a
            time, so it mainly overlaps the transfers).

    Raises:
        ValueError: a bad option, or ``token_env`` names an unset or empty variable.
    """

    name: ClassVar[str] = "remote"
    needs_group: ClassVar[bool] = False

    def __init__(self, url: str, components: Sequence[str] | Mapping[str, float] | None = None, *,
                 token_env: str | None = TOKEN_ENV, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
                 batch_size: int = 64, encoding: str = "auto", max_concurrency: int = 1) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or backoff < 0:
            raise ValueError(f"backoff must be a number of seconds >= 0, got {backoff!r}")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {list(ENCODINGS)}, got {encoding!r}")
        headers = {}
        if token_env is not None:
            token = os.environ.get(token_env, "").strip()
            if not token:
                raise ValueError(f"the remote scorer's token variable ${token_env} is unset or empty; export the "
                                 "server's bearer token there (or set token_env: null for a --no-auth server)")
            headers["Authorization"] = f"Bearer {token}"
        self.url = url.rstrip("/")
        self.weights = _weights(components)
        self.timeout, self.retries, self.backoff = float(timeout), retries, float(backoff)
        self.batch_size = check_batch_size(batch_size)
        self.encoding = encoding
        self.max_concurrency = max_concurrency
        self._lock = threading.Lock()
        self.failed_batches = 0
        """Batches scored NaN after their retries, over this scorer's life."""
        self.last_error: str | None = None
        """Why the last failed batch failed (the reward processor adds it to a required component's error and
        clears it before each step's calls)."""
        import httpx

        self._client = httpx.Client(headers=headers, timeout=self.timeout)

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request with retries. Returns the JSON answer.

        Raises:
            RemoteScorerError: a non-retryable 4xx. ConnectionError: still failing after the retries."""
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self._client.request(method, self.url + path, json=body)
            except httpx.TransportError as exc:  # timeouts, refused / reset connections, protocol errors
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in RETRY_STATUS:
                last = f"HTTP {response.status_code}: {_detail(response)}"
                continue
            if response.status_code >= 400:
                raise RemoteScorerError(f"reward service {self.url}{path} answered {response.status_code}: "
                                        f"{_detail(response)}")
            return response.json()
        raise ConnectionError(f"reward service {self.url}{path} failed after {self.retries + 1} attempts: {last}")

    def _resolve_components(self) -> dict[str, float]:
        if self.weights is None:
            hosted = sorted(self._request("GET", "/health")["scorers"])
            if len(hosted) != 1:
                raise ValueError(f"the reward service {self.url} hosts {hosted}; name the ones to use in the remote "
                                 "scorer's components option")
            self.weights = {hosted[0]: 1.0}
        return self.weights

    def _score_batch(self, media: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        try:
            weights = self._resolve_components()
            body = {"prompts": prompts, "metadata": metadata, "media": encode_images(media, self.encoding),
                    "components": list(weights)}
            scores = self._request("POST", "/score", body)["scores"]
        except ConnectionError as exc:
            with self._lock:
                self.failed_batches += 1
                self.last_error = str(exc)
            log.warning("remote scorer: %s; %d samples scored NaN", exc, len(prompts))
            return torch.full((len(prompts),), float("nan"))
        total = torch.zeros(len(prompts), dtype=torch.float64)
        for name, weight in weights.items():
            values = [float("nan") if v is None else v for v in scores[name]]
            part = torch.tensor(values, dtype=torch.float32).double()
            total = part if len(weights) == 1 and weight == 1.0 else total + weight * part
        return total.float()

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 on ``media``'s device (NaN where a batch failed
        after its retries or the server says "not applicable").

        Raises:
            ValueError: bad inputs; metadata that JSON cannot carry; :class:`RemoteScorerError` for a refused
                request; several hosted components and no ``components`` option.
        """
        batch = check_inputs(media, prompts, metadata)
        prompts, metadata = list(prompts), [dict(m) for m in metadata]
        _check_json(metadata)
        out = [self._score_batch(media[s:s + self.batch_size], prompts[s:s + self.batch_size],
                                 metadata[s:s + self.batch_size]) for s in range(0, batch, self.batch_size)]
        scores = torch.cat(out) if out else torch.empty(0)
        return scores.to(device=media.device, dtype=torch.float32)


def _detail(response: Any) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    return str(detail if detail is not None else response.text[:500])


def _check_json(metadata: list[dict[str, Any]]) -> None:
    import json

    for index, entry in enumerate(metadata):
        try:
            json.dumps(entry, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata[{index}] cannot be sent as JSON ({exc}); the remote scorer needs plain "
                             "JSON metadata") from None
