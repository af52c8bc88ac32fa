"""Verify lengths: how many of each request's γ drafts a round sends to the target (DESIGN 3, step 2).

A request r of a round verifies l_r tokens, [anchor, d_1 .. d_{l_r - 1}], with 1 <= l_r <= γ + 1
(l_r = 1: only the anchor, whose target row gives the bonus token); empty or inactive slots get 0.

1 Survival. The confidence head gives, per draft position k, a raw logit c_k whose sigmoid is the
  CONDITIONAL probability that d_k is accepted given that d_1 .. d_{k-1} were (it is trained on
  c* = 1 - TV(p_draft, p_target) at position k with the true prefix teacher-forced, and STS fits
  the products). The survival a_{r,k} = Π_{i<=k} sigmoid(c_{r,i} / T_i) (T_i: the per-position STS
  temperatures of ``sts.json``, 1 when absent) is the probability that the first k drafts are all
  accepted, so the expected tokens a request emits with l_r verify tokens are
  1 + Σ_{k < l_r} a_{r,k}. Survivals are non-increasing in k (each factor is <= 1).

2 SPS table. Rounds per second as a function of the verify tokens B = Σ_r l_r of the round,
  measured (``profile``), made non-increasing by an isotonic fit, keyed by what it was measured on.

3 Schedulers, all maximising the throughput Θ = τ · SPS(B), τ = Σ_r (1 + Σ_{k < l_r} a_{r,k}):
  - ``static_lengths``: γ + 1 for every active request.
  - ``confidence_lengths``: early stopping on the current round's survivals, bucket-aware
    (``bucket_early_stopping``): candidates (r, k) in the order below are admitted one by one
    while the most Θ could reach in the SPS bucket the next admission falls into (that bucket
    filled with copies of the candidate's survival) beats the Θ of stopping now; the first
    candidate that fails stops the search. With one bucket per token count this is the paper's
    Algorithm 1 (admit while Θ strictly grows); with the engine's padded buckets Algorithm 1
    stops at the first bucket edge (SPS steps down there, so the first draft past it lowers Θ
    although filling that bucket would raise it) and verifies the anchors alone. Lossless (the
    argument is in ``bucket_early_stopping``): whether d_k is verified depends on d_1 .. d_{k-1}
    (through a_{r,k}) and never on d_k itself. Its token total depends on the round's drafts,
    so the host reads the lengths to pick the verify bucket.
  - lagged (production): the capacity K (drafts to verify in total) is decided on the host before
    the round from survivals ``lag`` rounds old (``SurvivalHistory``, ``lagged_capacity``) by an
    unconstrained argmax of Θ, so it fixes the round's static token bucket n_active + K; on the
    device, ``allocate_topk`` gives the K best candidates of the CURRENT survivals. K cannot depend
    on this round's drafts, and a candidate (r, k+1) never outranks (r, k), so the verify decision
    for d_k depends on d_1 .. d_{k-1} only: lossless for any K.

Candidate order (both device schedulers): survival descending, then position ascending, then
request ascending. The tie-break uses no value, and a request's candidates come out as a prefix.

An uninitialised SPS table (no profile) makes every scheduler verify everything, with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

TABLE_FORMAT = "dspark_jax.sps_table"
TABLE_VERSION = 1
UNINITIALISED_WARNING = ("the SPS table is uninitialised (no step-time profile): every active request verifies "
                         "all γ + 1 tokens, so confidence scheduling gains nothing")


# ---------------------------------------------------------------------------- 1 survival
def survival(conf_logits: Float[Array, "r g"], temperatures: Sequence[float] | None = None) -> Float[Array, "r g"]:
    """a_{r,k} = Π_{i<=k} sigmoid(c_{r,i} / T_i) from raw confidence logits (``RoundOutput.confidence``,
    ``DraftOutput.confidence``) and the per-position STS temperatures (``Model.sts_temperatures``;
    None = 1). jnp, float32, jittable (the temperatures are constants). The same formula in float64
    numpy is ``dspark_jax.train.sts.survival``, which STS fits against."""
    c = jnp.asarray(conf_logits, jnp.float32)
    if c.ndim < 1:
        raise ValueError(f"confidence logits must have a position axis [..., γ], got shape {c.shape}")
    g = c.shape[-1]
    t = np.ones(g) if temperatures is None else np.asarray(temperatures, np.float64)
    if t.shape != (g,):
        raise ValueError(f"expected {g} STS temperatures (one per draft position), got shape {t.shape}")
    if not np.all(np.isfinite(t) & (t > 0)):
        raise ValueError(f"STS temperatures must be finite and positive, got {t.tolist()}")
    return jnp.cumprod(jax.nn.sigmoid(c / jnp.asarray(t, jnp.float32)), axis=-1)


# ---------------------------------------------------------------------------- 2 SPS table
class StaleTableError(ValueError):
    """An SPS table measured on something else (device, model, γ, numerics or KV layout)."""


@dataclasses.dataclass(frozen=True)
class TableKey:
    """What a step-time profile depends on; a table is refused where any field differs."""

    device_kind: str  # jax's device_kind, e.g. "NVIDIA H200"
    n_devices: int  # devices the model is spread over
    model: str  # ``config_fingerprint`` of the ModelConfig
    gamma: int
    dtype: str  # activation dtype
    weight_format: str  # Numerics.weight_format
    kv_layout: str  # "bf16" or "fp8" target KV pools


def config_fingerprint(config) -> str:
    """16 hex digits of a SHA-256 over every field of a (frozen dataclass) config."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def table_key(model, *, gamma: int, kv_layout: str) -> TableKey:
    """The key of an engine running ``model`` (a ``dspark_jax.Model``) with this γ and KV layout."""
    from dspark_jax.sharding import model_mesh

    mesh = model_mesh(model)
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    return TableKey(device_kind=devices[0].device_kind, n_devices=len(devices),
                    model=config_fingerprint(model.config), gamma=int(gamma), dtype=model.numerics.dtype.name,
                    weight_format=model.numerics.weight_format, kv_layout=kv_layout)


def _ceiling_lookup(tokens, steps_per_s, b, xp):
    """steps_per_s at the smallest count in ``tokens`` >= b (the one lookup rule)."""
    return steps_per_s[xp.minimum(xp.searchsorted(tokens, b, side="left"), tokens.shape[0] - 1)]


@dataclasses.dataclass(frozen=True)
class SPSTable:
    """Rounds per second at a set of verify-token counts.

    tokens: strictly increasing counts (the engine's compiled token buckets); steps_per_s: the
    fitted rounds per second there, non-increasing. Lookup rule (ceiling step function): a round
    of B verify tokens runs in the smallest profiled bucket >= B (the engine pads the packed
    token axis up to a compiled bucket), so SPS(B) = steps_per_s at that bucket; B beyond the
    last count is an error. measured_steps_per_s: 1 / median step time before the fit (for
    plots). static_steps_per_s: rounds per second of the pool's static round (every slot
    verifying γ + 1 tokens in one program, no ragged packing), None if not measured. An empty
    table is *uninitialised*: schedulers then verify everything.
    """

    tokens: tuple[int, ...]
    steps_per_s: tuple[float, ...]
    key: TableKey | None = None
    measured_steps_per_s: tuple[float, ...] | None = None
    meta: tuple[tuple[str, Any], ...] = ()  # free-form facts of the profile (not compared)
    static_steps_per_s: float | None = None

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)
        put("tokens", tuple(int(t) for t in self.tokens))
        put("steps_per_s", tuple(float(s) for s in self.steps_per_s))
        if self.static_steps_per_s is not None:
            put("static_steps_per_s", float(self.static_steps_per_s))
            if not (np.isfinite(self.static_steps_per_s) and self.static_steps_per_s > 0):
                raise ValueError(f"SPS table static rounds per second must be finite and positive, "
                                 f"got {self.static_steps_per_s}")
        if self.measured_steps_per_s is not None:
            put("measured_steps_per_s", tuple(float(s) for s in self.measured_steps_per_s))
        put("meta", tuple(sorted(dict(self.meta).items())))
        n = len(self.tokens)
        if len(self.steps_per_s) != n or (self.measured_steps_per_s is not None and len(self.measured_steps_per_s) != n):
            raise ValueError(f"SPS table: {n} token counts but {len(self.steps_per_s)} steps-per-second values")
        if any(t < 1 for t in self.tokens) or any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError(f"SPS table token counts must be positive and strictly increasing, got {self.tokens}")
        if not all(np.isfinite(s) and s > 0 for s in self.steps_per_s):
            raise ValueError(f"SPS table steps per second must be finite and positive, got {self.steps_per_s}")
        if any(b > a for a, b in zip(self.steps_per_s, self.steps_per_s[1:])):
            raise ValueError(f"SPS table steps per second must be non-increasing in tokens, got {self.steps_per_s} "
                             "(build tables with fit_table, which enforces it)")

    @classmethod
    def uninitialised(cls, key: TableKey | None = None) -> "SPSTable":
        return cls(tokens=(), steps_per_s=(), key=key)

    @property
    def initialised(self) -> bool:
        return len(self.tokens) > 0

    @property
    def static_dominates(self) -> bool:
        """The static round is at least as fast as the fastest ragged bucket. Then it has the
        highest throughput Θ = E[accepted] · SPS whatever the confidences: any ragged choice
        verifies a subset of the drafts (E[accepted] no larger than verifying all) at no more
        rounds per second than the static round."""
        return (self.initialised and self.static_steps_per_s is not None
                and self.static_steps_per_s >= self.steps_per_s[0])

    def check_covers(self, tokens: int) -> None:
        """Raise unless rounds of up to ``tokens`` verify tokens have a bucket in the table."""
        if self.initialised and tokens > self.tokens[-1]:
            raise ValueError(f"the SPS table stops at {self.tokens[-1]} verify tokens but a round can verify {tokens} "
                             f"(slots x (γ + 1)): profile up to at least {tokens}")

    def bucket(self, tokens: int) -> int:
        """The smallest profiled count >= ``tokens`` (the bucket a round of that many tokens runs in)."""
        if not self.initialised:
            raise ValueError("an uninitialised SPS table has no buckets")
        self.check_covers(int(tokens))
        return self.tokens[int(np.searchsorted(self.tokens, tokens, side="left"))]

    def steps_per_second(self, tokens, xp=np):
        """SPS(B) for an array of token counts B (ceiling rule); ``xp`` = numpy (host, float64; B past
        the table raises) or jax.numpy (traceable, float32; call ``check_covers`` first)."""
        if not self.initialised:
            raise ValueError("an uninitialised SPS table has no steps-per-second values")
        if xp is np:
            self.check_covers(int(np.max(tokens)))
        return _ceiling_lookup(xp.asarray(self.tokens), xp.asarray(self.steps_per_s), tokens, xp)

    def to_json(self) -> dict:
        return dict(format=TABLE_FORMAT, version=TABLE_VERSION,
                    key=None if self.key is None else dataclasses.asdict(self.key), tokens=list(self.tokens),
                    steps_per_s=list(self.steps_per_s),
                    measured_steps_per_s=None if self.measured_steps_per_s is None else list(self.measured_steps_per_s),
                    static_steps_per_s=self.static_steps_per_s, meta=dict(self.meta))

    def save(self, path: str) -> None:
        if not self.initialised:
            raise ValueError("refusing to save an uninitialised SPS table")
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    @classmethod
    def load(cls, path: str, key: TableKey) -> "SPSTable":
        """The table in ``path``, which must have been measured for ``key`` (else StaleTableError)."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"SPS table {path!r} does not exist")
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"SPS table {path!r} is not valid JSON ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != TABLE_FORMAT or raw.get("version") != TABLE_VERSION:
            raise ValueError(f"{path!r} is not an SPS table of format {TABLE_FORMAT} version {TABLE_VERSION}")
        try:
            stored = TableKey(**raw["key"])
        except (TypeError, KeyError) as e:
            raise ValueError(f"SPS table {path!r} has no valid key ({e})") from None
        if stored != key:
            diff = [f"{f.name}: table {getattr(stored, f.name)!r}, engine {getattr(key, f.name)!r}"
                    for f in dataclasses.fields(TableKey) if getattr(stored, f.name) != getattr(key, f.name)]
            raise StaleTableError(f"SPS table {path!r} was measured for another setup ({'; '.join(diff)}): "
                                  "profile again for this one")
        return cls(tokens=raw["tokens"], steps_per_s=raw["steps_per_s"], key=stored,
                   measured_steps_per_s=raw.get("measured_steps_per_s"),
                   static_steps_per_s=raw.get("static_steps_per_s"), meta=tuple((raw.get("meta") or {}).items()))


def isotonic_increasing(y: Sequence[float], w: Sequence[float]) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of y (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [Σ w·y, Σ w, count]
    for yi, wi in zip(y, w):
        blocks.append([wi * yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, sw, n = blocks.pop()
            blocks[-1] = [blocks[-1][0] + s, blocks[-1][1] + sw, blocks[-1][2] + n]
    return np.concatenate([np.full(n, s / sw) for s, sw, n in blocks]) if blocks else np.zeros(0)


def fit_table(step_seconds: Mapping[int, Sequence[float]], key: TableKey | None = None,
              meta: Mapping[str, Any] | None = None) -> SPSTable:
    """A table from measured round times (seconds) per verify-token count: the median per count,
    then an isotonic (PAVA) non-decreasing fit of the medians weighted by their sample counts,
    so SPS = 1 / fitted time is non-increasing in tokens."""
    if not step_seconds:
        raise ValueError("no step times to fit an SPS table on")
    tokens = sorted(step_seconds)
    for t in tokens:
        xs = list(step_seconds[t])
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 1:
            raise ValueError(f"token counts must be positive integers, got {t!r}")
        if not xs or not all(np.isfinite(x) and x > 0 for x in xs):
            raise ValueError(f"step times at {t} tokens must be a non-empty list of positive seconds, got {xs}")
    medians = np.array([statistics.median(step_seconds[t]) for t in tokens], np.float64)
    fitted = isotonic_increasing(medians, [len(step_seconds[t]) for t in tokens])
    return SPSTable(tokens=tuple(tokens), steps_per_s=tuple(1.0 / fitted), key=key,
                    measured_steps_per_s=tuple(1.0 / medians), meta=tuple((meta or {}).items()))


def profile(seconds: Callable[[int], float], token_counts: Sequence[int], key: TableKey | None = None, *,
            repeats: int = 5, warmup: int = 1, meta: Mapping[str, Any] | None = None,
            static_seconds: Callable[[], float] | None = None) -> SPSTable:
    """Time rounds at each verify-token count: ``seconds(tokens)`` runs one round of that many
    verify tokens and returns its wall time; the first ``warmup`` calls per count (compilation)
    are dropped, the next ``repeats`` fitted by ``fit_table``. ``static_seconds()``, if given,
    times the pool's static round the same way (its median sets ``static_steps_per_s``)."""
    counts = [int(t) for t in token_counts]
    if not counts or len(set(counts)) != len(counts):
        raise ValueError(f"token counts must be a non-empty list of distinct counts, got {list(token_counts)}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    times: dict[int, list[float]] = {}
    for t in sorted(counts):
        for _ in range(warmup):
            seconds(t)
        times[t] = [float(seconds(t)) for _ in range(repeats)]
    table = fit_table(times, key, dict(meta or {}, repeats=repeats, warmup=warmup))
    if static_seconds is None:
        return table
    for _ in range(warmup):
        static_seconds()
    median = statistics.median(float(static_seconds()) for _ in range(repeats))
    return dataclasses.replace(table, static_steps_per_s=1.0 / median)


def plot_table(table: SPSTable, path: str) -> None:
    """PNG of the table: fitted rounds per second (ceiling steps) and the measured medians."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not table.initialised:
        raise ValueError("an uninitialised SPS table has nothing to plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.asarray(table.tokens)
    ax.step(x, table.steps_per_s, where="pre", label="fitted SPS (ceiling lookup)")
    if table.measured_steps_per_s is not None:
        ax.plot(x, table.measured_steps_per_s, "o", ms=4, label="measured (1 / median)")
    if table.static_steps_per_s is not None:
        ax.axhline(table.static_steps_per_s, ls="--", c="gray", label="static round (all slots, γ + 1 each)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("verify tokens per round (B)")
    ax.set_ylabel("rounds per second")
    k = table.key
    ax.set_title("SPS table" if k is None else f"SPS: {k.device_kind} x{k.n_devices}, γ={k.gamma}, {k.dtype}, "
                 f"{k.weight_format}, kv {k.kv_layout}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def clairvoyant_bound(table: SPSTable, pass_rates: Sequence[float], slots: int, gamma: int, *,
                      rounds: int = 4096, seed: int = 0) -> dict[str, float]:
    """The most any verify allocation could gain over the static round on ``table``, for ``slots``
    decoding requests whose draft k passes with marginal probability ``pass_rates[k - 1]``
    (non-increasing). A clairvoyant scheduler verifies for each request exactly the anchor and
    the drafts that will pass, A_r + 1 tokens, emitting what verifying everything emits (A_r + 1)
    with the fewest verify tokens; no scheduler that reads confidences does better. Over
    ``rounds`` simulated rounds (A_r drawn from the rates), returns the ratio of its accepted
    tokens per second to the static round's (whose rate is ``table.static_steps_per_s``, else the
    table's rate at slots x (γ + 1)): ``buckets``, each round in the table's bucket (ceiling rule) or
    the static round, whichever is faster; ``every_count``, as if a bucket existed at every token
    count (round time interpolated linearly between the profiled counts), an upper bound for finer
    buckets. ``mean_verify_tokens``: its verify tokens per request and round (static: γ + 1)."""
    rates = np.asarray(pass_rates[:gamma], np.float64)
    if rates.shape[0] != gamma or np.any(np.diff(rates) > 0) or np.any((rates < 0) | (rates > 1)):
        raise ValueError(f"pass_rates must give {gamma} non-increasing probabilities, got {tuple(pass_rates)}")
    full = slots * (gamma + 1)
    table.check_covers(full)
    static_s = 1.0 / (table.static_steps_per_s or float(table.steps_per_second(np.asarray([full]))[0]))
    u = np.random.default_rng(seed).random((rounds, slots))
    tokens = ((u[..., None] < rates).sum(-1) + 1).sum(-1)  # A_r + 1 per request, summed per round
    bucket_s = np.minimum(1.0 / table.steps_per_second(tokens), static_s)
    count_s = np.minimum(np.interp(tokens, table.tokens, 1.0 / np.asarray(table.steps_per_s)), static_s)
    return {"buckets": float(static_s / bucket_s.mean()), "every_count": float(static_s / count_s.mean()),
            "mean_verify_tokens": float(tokens.mean() / slots)}


# ---------------------------------------------------------------------------- 3 schedulers
def static_lengths(active: Bool[Array, " r"], gamma: int) -> Int[Array, " r"]:
    """γ + 1 verify tokens for every active request, 0 for the others."""
    return jnp.where(active, gamma + 1, 0).astype(jnp.int32)


def _uninitialised(active, gamma: int) -> Int[Array, " r"]:
    warnings.warn(UNINITIALISED_WARNING, stacklevel=3)
    return static_lengths(active, gamma)


def _throughput(values_desc, n_valid, n_active, tokens, steps_per_s, xp):
    """Θ(m) = τ(m) · SPS(n_active + m) for m = 0 .. M, τ(m) = n_active + (sum of the m largest
    values); -inf for m > n_valid (candidates of inactive slots)."""
    m = xp.arange(values_desc.shape[0] + 1)
    tau = n_active + xp.concatenate([xp.zeros(1, values_desc.dtype), xp.cumsum(values_desc)])
    return xp.where(m <= n_valid, tau * _ceiling_lookup(tokens, steps_per_s, n_active + m, xp), -xp.inf)


def _candidates(surv: Float[Array, "r g"], active: Bool[Array, " r"]) -> tuple[Int[Array, " m"], Float[Array, " m"]]:
    """Flat candidate indices k * r + request (position-major) in scheduling order, and their
    survivals (inactive slots: -inf, last). A stable sort of -survival keeps equal survivals in
    flat order, i.e. position ascending, then request ascending."""
    v = jnp.where(active[None, :], jnp.asarray(surv, jnp.float32).T, -jnp.inf).reshape(-1)
    order = jnp.argsort(-v, stable=True)
    return order, v[order]


def _lengths(order: Int[Array, " m"], n_admit, active: Bool[Array, " r"], gamma: int) -> Int[Array, " r"]:
    """1 + admitted candidates per request (the first ``n_admit`` of ``order``); 0 if inactive."""
    r = active.shape[0]
    admitted = jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.shape[0]) < n_admit)
    return jnp.where(active, 1 + admitted.reshape(gamma, r).sum(axis=0), 0).astype(jnp.int32)


def _check_shapes(surv, active) -> tuple[int, int]:
    if surv.ndim != 2 or active.shape != surv.shape[:1]:
        raise ValueError(f"expected survivals [r, γ] and active [r], got shapes {surv.shape} and {active.shape}")
    return surv.shape


def allocate_topk(surv: Float[Array, "r g"], active: Bool[Array, " r"], capacity: Int[Array, ""] | int
                  ) -> Int[Array, " r"]:
    """The lagged scheduler's device half: the ``capacity`` best candidates of the current survivals
    (clipped to the active ones) are verified; l_r = 1 + their count in request r (0 if inactive).
    jnp, jittable, ``capacity`` may be traced: no host synchronisation."""
    _check_shapes(surv, active)
    return _topk(surv, active, capacity)


@jax.jit
def _topk(surv, active, capacity) -> Int[Array, " r"]:
    g = surv.shape[1]
    order, _ = _candidates(surv, active)
    return _lengths(order, jnp.clip(capacity, 0, jnp.sum(active) * g), active, g)


def confidence_lengths(surv: Float[Array, "r g"], active: Bool[Array, " r"], table: SPSTable) -> Int[Array, " r"]:
    """Bucket-aware early stopping on the current survivals (lossless; ``bucket_early_stopping``
    with the table's token counts as the buckets). jnp, jittable, fixed shapes (the table is a
    constant)."""
    r, g = _check_shapes(surv, active)
    if not table.initialised:
        return _uninitialised(active, g)
    table.check_covers(r * (g + 1))
    return bucket_early_stopping(surv, active, jnp.asarray(table.tokens), jnp.asarray(table.steps_per_s))


@jax.jit
def bucket_early_stopping(surv: Float[Array, "r g"], active: Bool[Array, " r"], tokens: Int[Array, " t"],
                          steps_per_s: Float[Array, " t"]) -> Int[Array, " r"]:
    """The confidence scheduler's verify lengths: early stopping that sees whole SPS buckets.

    Candidates c_1, c_2, .. in scheduling order (survival desc, position asc, request asc) have
    values v_1 >= v_2 >= .. (their survivals); n = active requests, M = n·γ candidates, τ(m) =
    n + v_1 + .. + v_m, Θ(m) = τ(m) · SPS(n + m). Buckets are the table's token counts: a round
    of B tokens runs in β(B), the smallest count >= B, at SPS(β(B)) (the ceiling rule). For
    m = 1, 2, .. the rule admits c_m iff

        U(m) = (τ(m) + (min(β(n + m), n + M) - (n + m)) · v_m) · SPS(n + m)  >  Θ(m - 1),

    and stops at the first m that fails; the round verifies c_1 .. c_{m-1} (the last admitted).
    U(m) is the Θ of filling the bucket of n + m with copies of v_m: every later candidate is
    worth at most v_m and every prefix ending in that bucket has its SPS, so no prefix ending in
    that bucket beats U(m). Inside a bucket the test is v_m > 0 (SPS is flat there); at a bucket
    edge it enters the next bucket only if filling it could beat stopping before it. With one
    bucket per token count (β(B) = B) U(m) = Θ(m) and the rule is the paper's Algorithm 1,
    admit while Θ strictly grows.

    Lossless. The order never puts (r, k+1) before (r, k) (its survival is <= a_{r,k}, and ties
    go by position). Whether c_m is admitted is a function of v_1 .. v_m (and of n, M and the
    table, which no draft value changes); so d_k of request r, candidate (r, k) at rank j, is
    verified iff the tests of ranks 1 .. j all pass: a function of the candidates ranked at or
    above (r, k) and their values. Which candidates those are and their values depend on a_{r,1}
    .. a_{r,k} (functions of d_1 .. d_{k-1}) and on the other requests (independent of request
    r's drafts), never on a_{r,k+1} .., the only values that read d_k. So whether d_k is
    verified does not depend on d_k, and chain rejection sampling capped at l_r - 1 stays exact.

    Why the cut is the last admitted candidate and the test compares with Θ(m - 1): cutting at
    the best Θ among the admitted prefixes instead would decide whether (r, k) is kept by
    the Θ of longer prefixes, which hold a_{r,k+1}, a value that reads d_k: the paper's
    Appendix A bias (tests/test_scheduler.py shows it on a bucketed table). Since the round
    ends at the last admitted prefix, what stopping gives is Θ(m - 1), not the best Θ seen
    earlier; comparing with the best would stop halfway through a bucket whose remaining
    candidates still raise Θ. The price of optimism: a bucket entered on the hope of U(m) can
    end below Θ(m - 1), by at most the factor SPS(new bucket) / SPS(previous one) (τ only grows).

    jnp, jittable, fixed shapes; the table as arrays (``tokens`` strictly increasing and covering
    n + M, ``steps_per_s`` non-increasing; may be traced: one program for every table of a
    length); the caller checks it (``confidence_lengths``)."""
    g = surv.shape[1]
    order, values = _candidates(surv, active)
    v = jnp.where(jnp.isfinite(values), values, 0.0)  # inactive slots' candidates: never admitted (m > M)
    n = jnp.sum(active).astype(jnp.int32)
    total = n * (g + 1)  # n + M
    m = jnp.arange(1, v.shape[0] + 1)
    tau = n + jnp.concatenate([jnp.zeros(1, v.dtype), jnp.cumsum(v)])  # τ(0 .. M')
    theta_prev = tau[:-1] * _ceiling_lookup(tokens, steps_per_s, n + m - 1, jnp)  # Θ(m - 1)
    bucket = tokens[jnp.minimum(jnp.searchsorted(tokens, n + m, side="left"), tokens.shape[0] - 1)]
    fill = jnp.maximum(jnp.minimum(bucket, total) - (n + m), 0)
    bound = (tau[1:] + fill * v) * _ceiling_lookup(tokens, steps_per_s, n + m, jnp)  # U(m)
    admit = (m <= n * g) & (bound > theta_prev)
    return _lengths(order, jnp.sum(jnp.cumprod(admit.astype(jnp.int32))), active, g)


def lagged_plan(surv: np.ndarray, active: np.ndarray, table: SPSTable) -> tuple[int, bool]:
    """The lagged scheduler's host half, from ``surv`` [slots, γ] = ``SurvivalHistory.lagged``:
    the capacity K = argmax_m Θ(m) over every m in 0 .. n_active·γ (no early stop; the smallest m
    on ties), whose rounds of n_active + K verify tokens run in bucket ``table.bucket(n_active +
    K)``; and whether the static round (every draft verified at ``table.static_steps_per_s``) has
    at least the throughput Θ(K) by the same survivals (False when the table has no static rate).
    Neither reads the round's own drafts."""
    surv, active = np.asarray(surv, np.float64), np.asarray(active, bool)
    r, g = _check_shapes(surv, active)
    n_active = int(active.sum())
    if not table.initialised:
        warnings.warn(UNINITIALISED_WARNING, stacklevel=3)
        return n_active * g, False
    table.check_covers(r * (g + 1))
    values = np.sort(surv[active].ravel())[::-1]
    if not np.all((values >= 0) & (values <= 1)):
        raise ValueError("survivals must lie in [0, 1]")
    theta = _throughput(values, values.size, n_active, np.asarray(table.tokens), np.asarray(table.steps_per_s), np)
    k = int(np.argmax(theta))
    static = table.static_steps_per_s is not None and (n_active + values.sum()) * table.static_steps_per_s >= theta[k]
    return k, bool(static)


def lagged_capacity(surv: np.ndarray, active: np.ndarray, table: SPSTable) -> int:
    """The lagged capacity K of ``lagged_plan``."""
    return lagged_plan(surv, active, table)[0]


@dataclasses.dataclass
class SurvivalHistory:
    """Per-slot survivals of past rounds, for the lagged capacity (host side, numpy).

    The host reads a round's outputs one round late, so when it schedules round t the newest
    survivals it has are those of round t - 2: ``lag`` = 2. ``record`` stores a round's survivals
    with the request each slot held; ``lagged(t, owner)`` gives those of round t - lag for slots
    that still hold the same request, and survival 1 (optimistic: everything worth verifying)
    for a slot whose request changed, that was not decoding then, or when round t - lag is unknown.

    Lossless only if no later round reuses the random draws behind these survivals: they depend
    on every draft of their round (c_k reads d_{k-1}), also those past the rejection, so the
    draft randomness of a round must be its own (keyed by the round, not only by position).
    """

    slots: int
    gamma: int
    lag: int = 2
    rounds: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.slots < 1 or self.gamma < 1 or self.lag < 1:
            raise ValueError(f"need slots, gamma and lag >= 1, got {self.slots}, {self.gamma}, {self.lag}")

    def record(self, round_index: int, owner: Sequence[int], active: Sequence[bool], surv: np.ndarray) -> None:
        """Round ``round_index``'s survivals [slots, γ]; ``owner`` = request id per slot (-1 free),
        ``active`` = slots that decoded in that round (e.g. n_new > 0)."""
        owner, active, surv = np.asarray(owner, np.int64), np.asarray(active, bool), np.asarray(surv, np.float64)
        if owner.shape != (self.slots,) or active.shape != (self.slots,) or surv.shape != (self.slots, self.gamma):
            raise ValueError(f"expected owner/active [{self.slots}] and survivals [{self.slots}, {self.gamma}], got "
                             f"{owner.shape}, {active.shape}, {surv.shape}")
        self.rounds[round_index] = (np.where(active, owner, -1), surv.copy())
        for old in [t for t in self.rounds if t < round_index - self.lag]:  # no longer asked for
            del self.rounds[old]

    def lagged(self, round_index: int, owner: Sequence[int]) -> np.ndarray:
        """Survivals [slots, γ] for scheduling round ``round_index``, from round ``round_index - lag``."""
        owner = np.asarray(owner, np.int64)
        if owner.shape != (self.slots,):
            raise ValueError(f"expected owner [{self.slots}], got shape {owner.shape}")
        out = np.ones((self.slots, self.gamma))
        if round_index - self.lag in self.rounds:
            then, surv = self.rounds[round_index - self.lag]
            same = (then == owner) & (owner >= 0)
            out[same] = surv[same]
        return out


@dataclasses.dataclass
class RoundTimes:
    """Round times measured while serving, held against the SPS table's predictions.

    The table is profiled one round at a time; a serving loop runs rounds back to back, reads
    them one round late and (confidence scheduler) waits for the verify lengths, so a ragged
    round can cost more there than its table entry says (on the H200 the shipped model's ragged
    rounds at 128 slots lost to the static round although the table had them faster). ``record``
    takes the ratio measured / predicted seconds of a round of each kind ("static" or
    "ragged"); a ragged ratio is kept with the static rounds' median ratio of its time (None
    before any static round is measured: then the latest median stands in). ``slowdown`` is how
    much slower the ragged rounds ran than predicted relative to the static round of their time
    (median over the last ``window`` ragged rounds; 1 while none is measured, or when ragged
    rounds do no worse), and ``corrected(table)`` divides the table's ragged rates by it. A
    later change of the static rounds alone does not move it: comparing old ragged times with
    new static ones made the lagged scheduler retry ragged rounds that were still slower (one
    pass at 0.87x static on the H200, docs/benchmarks.md). After ``explore_after`` static
    rounds in a row the ragged measurements are dropped, so ragged rounds are tried, and timed,
    again. The choices then depend on wall time, never on a round's drafts: lossless as before,
    but not reproducible from run to run (``Engine(adapt_sps=False)`` turns it off).
    The engine keeps one per pool, scheduler and table, so a later call starts from what the
    earlier ones measured (the first calls of each program compile and are not counted:
    ``programs``)."""

    window: int = 9
    explore_after: int = 256
    ratios: dict[str, list] = dataclasses.field(default_factory=lambda: {"static": [], "ragged": []})
    programs: set = dataclasses.field(default_factory=set)  # (kind, bucket) run before: their first call compiles
    _static_run: int = dataclasses.field(default=0, repr=False)  # static rounds since the last ragged one
    _last: tuple | None = dataclasses.field(default=None, repr=False)  # (table, factor, corrected table)

    def record(self, kind: str, predicted_s: float, measured_s: float) -> None:
        if kind not in self.ratios:
            raise ValueError(f"round kind must be 'static' or 'ragged', got {kind!r}")
        if not (predicted_s > 0 and measured_s > 0):
            raise ValueError(f"round times must be positive, got predicted {predicted_s}, measured {measured_s}")
        kept, ratio = self.ratios[kind], measured_s / predicted_s
        if kind == "ragged":
            kept.append((ratio, self._static_median()))
            self._static_run = 0
        else:
            kept.append(ratio)
            self._static_run += 1
            if self._static_run >= self.explore_after:
                self.ratios["ragged"].clear()
                self._static_run = 0
        del kept[:-self.window]

    def _static_median(self) -> float | None:
        return statistics.median(self.ratios["static"]) if self.ratios["static"] else None

    def slowdown(self) -> float:
        if not self.ratios["ragged"]:
            return 1.0
        latest = self._static_median() or 1.0
        return max(1.0, statistics.median(r / (s or latest) for r, s in self.ratios["ragged"]))

    def corrected(self, table: SPSTable) -> SPSTable:
        f = self.slowdown()
        if f == 1.0:
            return table
        if self._last is None or self._last[:2] != (table, f):  # a new table only when the factor moves
            self._last = (table, f, dataclasses.replace(table, steps_per_s=tuple(s / f for s in table.steps_per_s)))
        return self._last[2]
