"""HTTP services (leaves of the package: only the CLI and tests start them).

* :mod:`flowforge.serve.common` — bearer-token auth, the loopback rule, body-size limits, start-up line;
* :mod:`flowforge.serve.reward_server` — ``flowforge serve reward``: reward scorers over HTTP (``GET /health``,
  ``POST /score``), the server side of :class:`flowforge.rewards.scorers.remote.RemoteScorer`.
"""
