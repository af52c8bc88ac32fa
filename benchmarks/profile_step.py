"""Device profile of the target-only step and the DSpark round, per component, with rooflines.

Each mode (``target``: γ = 0, ``dspark``: γ = block size) is compiled once, timed without the
profiler (median wall time per round), then run for ``--rounds`` rounds under ``jax.profiler.trace``.
Every device kernel of the trace carries the name of the HLO instruction it runs (``hlo_op``); the
compiled module's text maps that instruction (and, for a fusion, the instructions fused into it)
to the ``op_name`` metadata written by the model's named scopes:

    <phase>/<layerN | stageN>/<component>/...   phase: draft, verify, accept_commit

component: embed, attention, indexer, compressor, mhc, moe, head, markov, confidence, context (the
draft rings' context keys, written at commit) or ``other`` (in accept_commit: the acceptance and
the cache commit themselves). A fusion of instructions from several
components goes to the one most of its (heavy) instructions belong to. Per round the script sums
device time per phase / component / layer, counts kernel launches, and takes host time = wall time
- device busy time (the union of kernel intervals). Under the profiler XLA runs CUDA graphs op by
op, so the traced round can be slower than the untraced one; both are reported.

Roofline per component: bytes = its weights as stored read once per round (routed experts: the
expected number of distinct chosen experts) + its cache reads at the given context; FLOPs = 2 x
tokens x the weights it multiplies + attention / indexer scores. Time = max(bytes / copy bandwidth,
FLOPs / bf16 matmul peak), both measured in the same run (``benchmarks.common.ceilings``).

Caches hold zeros at committed length ``--context`` (the work of a round depends on the lengths,
not on the cache contents); ``--prefill`` fills them by a real prefill instead (one more compile
per mode).

    python -m benchmarks.profile_step --layers 4 --batch 1 --context 2048 --rounds 5
    python -m benchmarks.profile_step --smoke          # tiny config on CPU: checks the script runs

Writes profile.json and profile.png under $OUT; prints each part as soon as it is measured.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

PHASES = ("draft", "verify", "accept_commit")
COMPONENTS = ("embed", "attention", "indexer", "compressor", "mhc", "moe", "head", "markov", "confidence",
              "context")
LISTED_LAYERS = ("L1", "L2")  # layers whose every kernel the results list (window-only; C4 + indexer)
_LAYER = re.compile(r"^(layer|stage)(\d+)$")
# Instructions that launch nothing themselves (their operands' kernels or their bodies do).
_NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "copy-start", "copy-done", "opt-barrier",
              "add-dependency", "domain"}
_HEAVY = {"dot", "convolution", "custom-call", "scatter", "gather", "reduce", "sort", "reduce-window",
          "dynamic-update-slice", "dynamic-slice"}


# ----------------------------------------------------------------------------- attribution
@dataclasses.dataclass(frozen=True)
class Scope:
    phase: str  # draft / verify / accept_commit / other
    layer: str  # "L3" (target layer 3), "S1" (draft stage 1) or ""
    component: str  # one of COMPONENTS or "other"


def scope_of(op_name: str) -> Scope:
    """The phase, layer and component named by an op_name's scopes (the innermost component wins)."""
    phase, layer, component = "other", "", "other"
    for part in op_name.split("/"):
        if part in PHASES and phase == "other":
            phase = part
        m = _LAYER.match(part)
        if m:
            layer = ("L" if m.group(1) == "layer" else "S") + m.group(2)
        if part in COMPONENTS:
            component = part
    return Scope(phase, layer, component)


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    op_name: str
    fused: tuple[str, ...]  # computations run inside this instruction's kernel (fusion bodies, reducers)
    operands: tuple[str, ...]
    called: tuple[str, ...]  # every computation it names (fused, loop bodies, called functions)


_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"\b(?:calls|to_apply|called_computations|body|condition|branch_computations|true_computation|"
                     r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_RUNS_OWN_KERNELS = ("call", "while", "conditional")  # the computations they name launch their own kernels


def parse_hlo(text: str) -> tuple[dict[str, Instruction], dict[str, list[str]]]:
    """Instructions of an HLO module's text by name, and the instruction names of each computation."""
    instrs, comps, current = {}, collections.defaultdict(list), None
    for line in text.splitlines():
        if not line.startswith(" "):  # a computation header "[ENTRY ]%name (params) -> type {" or "}"
            head = line.split()
            if line.rstrip().endswith("{") and head:
                current = (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")
            continue
        lhs, sep, rhs = line.partition(" = ")
        rhs = " " + rhs
        opcode = _OPCODE.search(rhs) if sep else None
        if current is None or opcode is None:
            continue
        name = lhs.split()[-1].lstrip("%")
        op = _OP_NAME.search(rhs)
        called = tuple(c.strip().lstrip("%") for ref in _CALLED.findall(rhs) for c in ref.strip("{}").split(","))
        fused = () if opcode.group(1) in _RUNS_OWN_KERNELS else called
        args = rhs[opcode.end():].split(")")[0]
        operands = tuple(re.findall(r"%?([A-Za-z_][\w.\-]*)", args))  # (type names too: never instructions)
        instrs[name] = Instruction(name, opcode.group(1), op.group(1) if op else "", fused, operands, called)
        comps[current].append(name)
    return instrs, dict(comps)


UNKNOWN = Scope("other", "", "other")


class Attribution:
    """HLO instruction name -> Scope, from a compiled module's text.

    An instruction without scopes of its own (the body of an inner jitted function keeps that
    function's op_names) takes the scope of the instruction that calls its computation. Some
    compiler passes drop the metadata of the instructions they create; such an instruction takes
    the scope of the nearest instruction it feeds (else of the nearest one feeding it): ``inferred``
    holds them."""

    def __init__(self, hlo_text: str):
        self.instrs, self.comps = parse_hlo(hlo_text)
        self.comp_of = {n: c for c, names in self.comps.items() for n in names}
        self.caller = {c: ins.name for ins in self.instrs.values() for c in ins.called}
        self.users = collections.defaultdict(list)
        for ins in self.instrs.values():
            for o in ins.operands:
                self.users[o].append(ins.name)
        self._own: dict[str, Scope] = {}
        self._cache: dict[str, Scope | None] = {}
        self.inferred: set[str] = set()

    def _votes(self, name: str, votes: collections.Counter, depth: int = 0):
        ins = self.instrs[name]
        if ins.opcode == "fusion" and depth < 8:
            for comp in ins.fused:
                for inner in self.comps.get(comp, ()):
                    self._votes(inner, votes, depth + 1)
        elif ins.opcode not in _NO_KERNEL and ins.op_name:
            votes[scope_of(ins.op_name)] += 10 if ins.opcode in _HEAVY else 1

    def _voted(self, name: str) -> Scope:
        """The scope most of the instruction's (fused) instructions name."""
        if name not in self._own:
            votes = collections.Counter()
            self._votes(name, votes)
            votes.pop(UNKNOWN, None)
            own = scope_of(self.instrs[name].op_name)
            # ties (and fusions of unnamed instructions) go to the instruction's own metadata
            s = max(votes, key=lambda s: (votes[s], s == own)) if votes else own
            self._own[name] = UNKNOWN  # (a guard against cycles)
            caller = self.caller.get(self.comp_of.get(name))
            if s == UNKNOWN and caller is not None:
                s = self._voted(caller)
            self._own[name] = s
        return self._own[name]

    def _nearest(self, name: str, links, steps: int = 8) -> Scope:
        frontier, seen = [name], {name}
        for _ in range(steps):
            frontier = [n for f in frontier for n in links(f) if n in self.instrs and n not in seen]
            seen.update(frontier)
            for n in frontier:
                if self._voted(n) != UNKNOWN:
                    return self._voted(n)
        return UNKNOWN

    def scope(self, hlo_op: str) -> Scope | None:
        """The scope of the kernel that runs instruction ``hlo_op`` (None: not in this module)."""
        if hlo_op not in self._cache:
            if hlo_op not in self.instrs:
                self._cache[hlo_op] = None
            else:
                s = self._voted(hlo_op)
                if s == UNKNOWN:
                    s = self._nearest(hlo_op, lambda n: self.users.get(n, ()))
                    if s == UNKNOWN:
                        s = self._nearest(hlo_op, lambda n: self.instrs[n].operands)
                    if s != UNKNOWN:
                        self.inferred.add(hlo_op)
                self._cache[hlo_op] = s
        return self._cache[hlo_op]

    def describe(self, name: str, limit: int = 5) -> str:
        """What a kernel computes, for reading a profile: the last parts of the op_names of its
        (fused) instructions, e.g. ``moe/gate: top_k, sqrt, ...``."""
        ins = self.instrs.get(name)
        if ins is None:
            return ""
        inner = [self.instrs[i] for c in ins.fused for i in self.comps.get(c, ()) if i in self.instrs] or [ins]
        parts = []
        for i in inner:
            tail = "/".join(i.op_name.split("/")[-2:]) if i.op_name else ""
            if tail and tail not in parts and i.opcode not in _NO_KERNEL:
                parts.append(tail)
        return f"{ins.opcode}: " + ", ".join(parts[:limit])

    def kernel_instructions(self) -> list[str]:
        """Kernel-launching instructions of the entry computation and of loop bodies."""
        inlined = {c for ins in self.instrs.values() for c in ins.fused}
        return [n for comp, names in self.comps.items() if comp not in inlined for n in names
                if self.instrs[n].opcode not in _NO_KERNEL]

    def static_kernels(self) -> collections.Counter:
        """``kernel_instructions`` by scope."""
        return collections.Counter(self.scope(n) for n in self.kernel_instructions())


# ----------------------------------------------------------------------------- trace events
@dataclasses.dataclass
class KernelEvent:
    hlo_op: str
    start_ns: float
    dur_ns: float
    line: str = ""
    run: int | None = None  # the execution it belongs to, where the trace says
    kernel: str = ""  # the event's own name (the device kernel's)


_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "XLA TraceMe", "Framework", "Source code", "TensorFlow")


def trace_events(path: str, module: str) -> tuple[list[KernelEvent], str]:
    """Kernel events of HLO module ``module`` in an .xplane.pb: device planes when there are any
    (GPU), else the host's XLA CPU thunk events. When no event names that module, those of the
    module with the most events (said so). Returns (events, source description)."""
    data = jax.profiler.ProfileData.from_file(path)
    by_module = collections.defaultdict(lambda: ([], []))
    unnamed = collections.Counter()  # device events without an hlo_op (diagnosis: what the trace holds)
    for plane in data.planes:
        is_device = plane.name.startswith("/device:")
        if not is_device and plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name.startswith(_DERIVED_LINES):
                continue
            for ev in line.events:
                with warnings.catch_warnings():  # some jaxlib builds warn when their stats are iterated
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(ev.stats)
                if "hlo_op" not in stats:
                    if is_device:
                        unnamed[(ev.name[:60], tuple(sorted(stats))[:8])] += 1
                    continue
                run = stats.get("run_id")
                e = KernelEvent(str(stats["hlo_op"]), float(ev.start_ns), float(ev.duration_ns),
                                f"{plane.name}/{line.name}", int(run) if run is not None else None, str(ev.name))
                by_module[str(stats.get("hlo_module", ""))][0 if is_device else 1].append(e)
    note = ""
    if module not in by_module and by_module:
        found = max(by_module, key=lambda m: len(by_module[m][0]) + len(by_module[m][1]))
        note, module = f"; no event of module {module!r}, took {found!r} of {sorted(by_module)}", found
    device, host = by_module[module]
    if unnamed:
        note += f"; device events without hlo_op: {sum(unnamed.values())}, e.g. {unnamed.most_common(3)}"
    if device:
        return leaf_events(device), "device kernels (" + ", ".join(sorted({e.line for e in device})[:4]) + ")" + note
    return leaf_events(host), "host-side XLA CPU thunks (no device plane in this trace)" + note


def leaf_events(events: list[KernelEvent]) -> list[KernelEvent]:
    """Drop events that enclose another event of the same line (a loop thunk around its body's ops)."""
    out = []
    by_line = collections.defaultdict(list)
    for e in events:
        by_line[e.line].append(e)
    for evs in by_line.values():
        evs.sort(key=lambda e: (e.start_ns, -e.dur_ns))
        for i, e in enumerate(evs):
            nxt = evs[i + 1] if i + 1 < len(evs) else None
            if nxt is not None and nxt.start_ns < e.start_ns + e.dur_ns and \
                    nxt.start_ns + nxt.dur_ns <= e.start_ns + e.dur_ns:
                continue
            out.append(e)
    return out


def busy_ns(events: list[KernelEvent]) -> float:
    """Length of the union of the events' intervals."""
    total, end = 0.0, -np.inf
    for e in sorted(events, key=lambda e: e.start_ns):
        s, f = e.start_ns, e.start_ns + e.dur_ns
        if f > end:
            total += f - max(s, end)
            end = f
    return total


def equal_runs(events: list[KernelEvent], rounds: int) -> list[list[KernelEvent]]:
    """The events in start order, cut into ``rounds`` runs of equal length."""
    evs, n = sorted(events, key=lambda e: e.start_ns), len(events) // rounds
    return [evs[i * n:(i + 1) * n] for i in range(rounds)]


def same_kernels(runs: list[list[KernelEvent]]) -> bool:
    """Whether every run launched the same kernels."""
    return len({tuple(sorted(e.hlo_op for e in run)) for run in runs}) == 1


def round_groups(events: list[KernelEvent], rounds: int) -> list[list[KernelEvent]]:
    """The events of each execution: grouped by run id where every event has one; else the
    start-ordered events in ``rounds`` runs of equal length where those launch the same kernels (an
    execution starts only after the one before it has ended); else split at the ``rounds - 1``
    widest gaps between kernels (which a DSpark round's own gaps can outdo where rounds run back to
    back)."""
    if not events:
        return []
    if all(e.run is not None for e in events) and len({e.run for e in events}) == rounds:
        groups = collections.defaultdict(list)
        for e in events:
            groups[e.run].append(e)
        parts = list(groups.values())
    elif len(events) % rounds == 0 and same_kernels(runs := equal_runs(events, rounds)):
        parts = runs
    else:
        evs = sorted(events, key=lambda e: e.start_ns)
        ends = np.maximum.accumulate([e.start_ns + e.dur_ns for e in evs])
        gaps = [evs[i + 1].start_ns - ends[i] for i in range(len(evs) - 1)]
        cuts = sorted(np.argsort(gaps)[::-1][:rounds - 1] + 1) if rounds > 1 else []
        parts = [list(p) for p in np.split(np.array(evs, dtype=object), cuts)]
    return parts


def round_spans_ns(events: list[KernelEvent], rounds: int) -> list[float]:
    """First kernel start to last kernel end of each execution (``round_groups``)."""
    return [max(e.start_ns + e.dur_ns for e in p) - min(e.start_ns for e in p) for p in round_groups(events, rounds)]


def attribute(events: list[KernelEvent], attr: Attribution, rounds: int) -> dict:
    """Per-round device time (ms) and kernel launches by phase / component, by layer, and the
    unattributed instructions (not found in the module's text)."""
    by_comp = collections.defaultdict(lambda: [0.0, 0])
    by_layer = collections.defaultdict(lambda: [0.0, 0])
    by_kernel = collections.defaultdict(lambda: [0.0, 0])
    by_layer_comp = collections.defaultdict(lambda: [0.0, 0])
    by_phase = collections.defaultdict(lambda: [0.0, 0])
    missing = collections.Counter()
    inferred = 0
    listed = {}  # every kernel of the listed layers: hlo_op -> [first start, total ns, launches, scope]
    for e in events:
        inferred += attr.scope(e.hlo_op) is not None and e.hlo_op in attr.inferred
        s = attr.scope(e.hlo_op)
        if s is None:
            missing[e.hlo_op] += 1
            key, layer = "unattributed", ""
        else:
            key, layer = f"{s.phase}/{s.component}", s.layer
        if layer in LISTED_LAYERS:
            first = listed.setdefault(e.hlo_op, [e.start_ns, 0.0, 0, key])
            first[0], first[1], first[2] = min(first[0], e.start_ns), first[1] + e.dur_ns, first[2] + 1
        tables = ((by_comp, key), (by_layer, layer or "-"), (by_kernel, e.hlo_op),
                  (by_layer_comp, (layer, key.split("/")[-1])), (by_phase, key.split("/")[0]))
        for table, k in tables:
            table[k][0] += e.dur_ns
            table[k][1] += 1

    def per_round(table):
        return {k: {"ms": v[0] / rounds / 1e6, "launches": v[1] / rounds}
                for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])}

    top = per_round(by_kernel)
    layer_components = collections.defaultdict(dict)
    for (layer, comp), v in sorted(by_layer_comp.items()):
        if layer:
            layer_components[layer][comp] = {"ms": v[0] / rounds / 1e6, "launches": v[1] / rounds}
    return {"phases": per_round(by_phase), "components": per_round(by_comp), "layers": per_round(by_layer),
            "layer_components": dict(layer_components),
            "top_kernels": {k: dict(v, scope=dataclasses.asdict(attr.scope(k)) if attr.scope(k) else None)
                            for k, v in list(top.items())[:25]},
            "unattributed_ops": dict(missing.most_common(10)),
            "launches_scope_inferred": inferred / rounds,
            "listed_layer_kernels": [  # in launch order: instruction, phase/component, us per round, launches
                [op, v[3], round(v[1] / rounds / 1e3, 2), v[2] / rounds, attr.describe(op)]
                for op, v in sorted(listed.items(), key=lambda kv: kv[1][0])]}


def timeline(events: list[KernelEvent], attr: Attribution, rounds: int) -> dict:
    """The listed layers' kernels in one execution (the middle one of ``rounds``, ``round_groups``):
    per layer its span (first start to last end), busy time (the union of its kernels) and idle
    time (span - busy: no kernel of the layer running), and each kernel as [instruction, start us
    from the layer's first, duration us, trace line, description]. Where the step runs as a
    concurrent command buffer, overlapping kernels show there; where none of the round's events
    names an instruction of the program (the command buffer's kernels), the whole round under
    "round", each kernel described by its device name ({} without events)."""
    runs = round_groups(events, rounds)
    if not runs:
        return {}
    run = sorted(runs, key=lambda r: min(e.start_ns for e in r))[len(runs) // 2]
    if all(attr.scope(e.hlo_op) is None for e in run):  # (a command buffer's kernels, named otherwise)
        return {"round": _timeline_of(sorted(run, key=lambda e: e.start_ns), attr)}
    out = {}
    for layer in LISTED_LAYERS:
        evs = sorted((e for e in run if (s := attr.scope(e.hlo_op)) is not None and s.layer == layer),
                     key=lambda e: e.start_ns)
        if not evs:
            continue
        out[layer] = _timeline_of(evs, attr)
    return out


def _timeline_of(evs: list[KernelEvent], attr: Attribution) -> dict:
    t0 = evs[0].start_ns
    span = max(e.start_ns + e.dur_ns for e in evs) - t0
    busy = busy_ns(evs)
    return {"span_us": span / 1e3, "busy_us": busy / 1e3, "idle_us": (span - busy) / 1e3,
            "kernels": [[e.hlo_op, round((e.start_ns - t0) / 1e3, 2), round(e.dur_ns / 1e3, 2), e.line,
                         attr.describe(e.hlo_op) if attr.scope(e.hlo_op) else e.kernel] for e in evs]}


# ----------------------------------------------------------------------------- roofline
def _dotted(path) -> str:
    parts = re.findall(r"\[['\"]?([^\]'\"]+)['\"]?\]|\.(\w+)", jax.tree_util.keystr(path))
    names = [a or b for a, b in parts]
    return ".".join(n for n in names if n != "value")


def param_scope(path: str) -> Scope:
    """Where a parameter is read in a round (the draft head's lm_head is the target's: counted there
    by ``roofline``)."""
    p = path.split(".")
    if p[0] == "embed":
        return Scope("verify", "", "embed")
    if p[0] in ("norm", "head") or p[0].startswith("hc_head"):
        return Scope("verify", "", "head")
    if p[0] not in ("layers", "mtp"):
        return Scope("other", "", "other")
    phase, layer = ("verify", f"L{p[1]}") if p[0] == "layers" else ("draft", f"S{p[1]}")
    rest = p[2:]
    if rest[0] in ("main_proj", "main_norm"):
        return Scope("accept_commit", "", "context")
    if rest[0] in ("markov_head", "confidence_head"):
        return Scope(phase, layer, "markov" if rest[0] == "markov_head" else "confidence")
    if rest[0] in ("norm",) or rest[0].startswith("hc_head"):
        return Scope(phase, "", "head")
    if rest[0].startswith(("hc_attn", "hc_ffn")):
        return Scope(phase, layer, "mhc")
    if rest[0] in ("attn", "attn_norm"):
        comp = "compressor" if "compressor" in rest else "indexer" if "indexer" in rest else "attention"
        return Scope(phase, layer, comp)
    return Scope(phase, layer, "moe")


def _nbytes(x) -> float:
    return float(x.size * jnp.dtype(x.dtype).itemsize)  # (abstract arrays too)


def _pool_bytes_per_row(pool) -> float:
    leaves = jax.tree_util.tree_leaves(pool)
    return sum(_nbytes(x) for x in leaves) / (leaves[0].shape[0] * leaves[0].shape[1])


def roofline(cfg, params, cache, draft, gamma: int, context: int, ceil: dict) -> dict:
    """Ideal bytes / FLOPs / time per phase/component of one round (module docstring) of a model
    with config ``cfg`` and parameters ``params`` (its state; abstract arrays do), with the target
    ``cache`` and ``draft`` rings of a batch at committed length ``context``."""
    b = int(cache.lengths.shape[0])
    n_verify, n_draft = b * (gamma + 1), b * gamma
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    acc = collections.defaultdict(lambda: {"bytes": 0.0, "flops": 0.0})

    def add(phase, comp, nbytes=0.0, flops=0.0):
        acc[f"{phase}/{comp}"]["bytes"] += nbytes
        acc[f"{phase}/{comp}"]["flops"] += flops

    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = _dotted(path)
        s = param_scope(name)
        if s.phase == "other" or gamma == 0 and (s.phase == "draft" or s.component == "context"):
            continue
        tokens = n_draft if s.phase == "draft" else n_verify  # (context: the γ + 1 verified rows)
        matrix = x.ndim == 2 and x.shape[0] > 1 and not name.endswith("scale")
        nbytes, flops = _nbytes(x), 2.0 * tokens * x.size if matrix else 0.0
        if ".experts." in name:  # routed experts: the expected distinct chosen ones, k per token
            nbytes *= 1.0 - (1.0 - k / e) ** tokens
            flops = 2.0 * tokens * k * x.size / e if x.ndim == 3 and not name.endswith("_scale") else 0.0
        elif s.component == "embed" or name.endswith("tid2eid"):  # rows gathered by token id
            nbytes, flops = tokens * _nbytes(x) / x.shape[0], 0.0
        elif name.endswith("markov_w1.weight"):  # one row per Markov step
            nbytes, flops = gamma * b * _nbytes(x) / x.shape[0], 0.0
        elif name.endswith("markov_w2.weight"):  # read once per step of the sequential loop
            nbytes, flops = gamma * nbytes, 2.0 * gamma * b * x.size
        add(s.phase, s.component, nbytes, flops)
        if gamma and name.startswith("mtp.") and (".attn.wkv." in name or ".attn.kv_norm." in name):
            # write_context projects the γ + 1 verified rows through every stage's wkv / kv_norm again
            add("accept_commit", "context", _nbytes(x), 2.0 * n_verify * x.size if matrix else 0.0)
        if gamma and name == "head.weight":  # the draft's base logits use the target's lm_head
            add("draft", "head", _nbytes(x), 2.0 * n_draft * x.size)

    # cache reads and attention / indexer score FLOPs
    h, d = cfg.num_attention_heads, cfg.head_dim
    win = min(cfg.sliding_window, context + gamma + 1)
    for i, lc in enumerate(cache.layers):
        ratio = cfg.compress_ratios[i]
        add("verify", "attention", b * win * _pool_bytes_per_row(lc.window), 4.0 * n_verify * h * d * win)
        if ratio:
            n_vis = context // ratio
            add("verify", "compressor", _nbytes(lc.compressor.kv) + _nbytes(lc.compressor.score))
            keys = min(n_vis, cfg.index_topk) if ratio == 4 else n_vis
            read = min(n_vis, (gamma + 1) * cfg.index_topk) if ratio == 4 else n_vis
            add("verify", "attention", b * read * _pool_bytes_per_row(lc.compressor.entries),
                4.0 * n_verify * h * d * keys)
        if ratio == 4:
            add("verify", "indexer", b * (context // 4) * _pool_bytes_per_row(lc.indexer.entries)
                + _nbytes(lc.indexer.kv) + _nbytes(lc.indexer.score),
                2.0 * n_verify * cfg.index_n_heads * cfg.index_head_dim * (context // 4))
    if gamma and draft is not None:
        for ring in draft.rings:
            keys = min(cfg.sliding_window, context) + gamma
            add("draft", "attention", b * min(cfg.sliding_window, context) * _pool_bytes_per_row(ring),
                4.0 * n_draft * h * d * keys)

    bw, peak = ceil["copy_GBps"] * 1e9, ceil["bf16_matmul_TFLOPs"] * 1e12
    out = {}
    for key, v in sorted(acc.items()):
        t_b, t_f = v["bytes"] / bw, v["flops"] / peak
        out[key] = {"MB": v["bytes"] / 1e6, "GFLOP": v["flops"] / 1e9, "ms": 1e3 * max(t_b, t_f),
                    "bound": "bytes" if t_b >= t_f else "flops"}
    return out


# ----------------------------------------------------------------------------- driver
def build(args):
    import dspark_jax

    if args.smoke:
        cfg = dspark_jax.config.tiny()
    else:
        cfg = dspark_jax.config.flash_slice(args.layers)
        if args.experts:
            cfg = cfg.replace(n_routed_experts=args.experts)
    model = dspark_jax.init(cfg, 0, dtype=jnp.bfloat16, weight_format=args.weights, quant_sim=True)
    if args.sinkhorn != "auto":
        model = dspark_jax.with_numerics(model, sinkhorn=args.sinkhorn)
    return dspark_jax.with_dense_copies(model) if args.dense_copies else model


def prepare(model, eng, args):
    """A batch state at committed length ``context`` (zero caches, or a real prefill)."""
    from dspark_jax import SamplingParams

    rng = np.random.default_rng(0)
    v = model.config.vocab_size
    prompts = [rng.integers(3, v - 1, args.context) for _ in range(args.batch)]
    params = [SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)] * args.batch
    rounds = 2 * args.rounds + args.warmup  # untraced + traced
    max_len = -(-(args.context + rounds * (eng.gamma + 1) + 32) // 128) * 128
    bs = eng.init_state(prompts, params, list(range(args.batch)), max_len)
    if args.prefill:
        bs, _ = eng.prefill(bs, prompts)
        return bs
    cache = dataclasses.replace(bs.cache, lengths=jnp.full((args.batch,), args.context, jnp.int32))
    return dataclasses.replace(bs, cache=cache, anchor=jnp.asarray(rng.integers(3, v - 1, args.batch), jnp.int32),
                               n_generated=jnp.ones((args.batch,), jnp.int32))


def module_name(hlo_text: str) -> str:
    """The HLO module name of a compiled round's text (its trace events carry it)."""
    return hlo_text.split(",")[0].split()[-1] if hlo_text.startswith("HloModule") else "jit__round_impl"


def written_events(trace_dir: str, module: str) -> tuple[list[KernelEvent], str]:
    """``trace_events`` of the last trace file written under ``trace_dir``."""
    files = sorted(glob.glob(os.path.join(glob.escape(trace_dir), "**", "*.xplane.pb"), recursive=True))
    if not files:
        raise RuntimeError(f"no .xplane.pb written under {trace_dir}")
    return trace_events(files[-1], module)


def traced_rounds(compiled, params, bs, rounds: int, trace_dir: str):
    """``rounds`` rounds of a compiled round dispatched back to back under the profiler; returns
    (the state after them, the trace's kernel events of the round's module and their source)."""
    with profiler_trace(trace_dir):
        for _ in range(rounds):
            bs, res = compiled(params, bs)
        jax.block_until_ready(res.tokens)
    return bs, *written_events(trace_dir, module_name(compiled.as_text()))


def profile_mode(model, name: str, gamma: int, args, ceil: dict, trace_root: str, save) -> dict:
    """Compile, time and profile one mode; ``save(partial result)`` after each part (a killed run
    keeps what it measured)."""
    from dspark_jax.decoding.engine import Engine

    eng = Engine(model, gamma=gamma, kv_layout=args.kv_layout)
    bs = prepare(model, eng, args)
    t0 = time.time()
    compiled = eng._round.lower(eng.params, bs, sampled=False, top_k=False, top_p=False).compile()
    out = {"mode": name, "gamma": gamma, "compile_s": time.time() - t0}
    text = compiled.as_text()
    if args.hlo:  # the compiled program as XLA scheduled it (its fusions, command buffers, streams)
        from benchmarks.common import out_dir
        with open(os.path.join(out_dir(), f"{args.name}.{name}.hlo.txt"), "w") as f:
            f.write(text)
    module = module_name(text)
    attr = Attribution(text)
    static, per_layer = collections.Counter(), collections.Counter()
    for s, n in attr.static_kernels().items():
        static[f"{s.phase}/{s.component}"] += n
        per_layer[s.layer or "-"] += n
    out["static_kernels"] = dict(static.most_common())  # kernel-launching instructions of the program
    out["static_kernels_per_layer"] = dict(sorted(per_layer.items()))
    out["roofline"] = roofline(model.config, model.state, bs.cache, bs.draft, gamma, args.context, ceil)
    out["roofline_ms"] = sum(v["ms"] for v in out["roofline"].values())
    print(name, "compiled in", round(out["compile_s"], 1), "s;", sum(static.values()), "kernel instructions;",
          "roofline", round(out["roofline_ms"], 4), "ms", flush=True)
    save(out)

    state = eng.params

    def timed_rounds(bs):
        """``args.rounds`` rounds, each waited for; returns the state and the seconds of each."""
        times = []
        for _ in range(args.rounds):
            t1 = time.perf_counter()
            bs, res = compiled(state, bs)
            jax.block_until_ready(res.tokens)
            times.append(time.perf_counter() - t1)
        return bs, times

    for _ in range(args.warmup):
        bs, res = compiled(state, bs)
    jax.block_until_ready(res.tokens)
    bs, times = timed_rounds(bs)
    out["wall_ms"] = 1e3 * float(np.median(times))
    print(name, "round (no profiler):", round(out["wall_ms"], 3), "ms", flush=True)
    save(out)

    trace_dir = os.path.join(trace_root, name)
    with profiler_trace(trace_dir):
        bs, traced = timed_rounds(bs)
    out["traced_wall_ms"] = 1e3 * float(np.mean(traced))
    try:
        events, source = written_events(trace_dir, module)
    except (RuntimeError, AttributeError) as err:  # no trace file; a jax without jax.profiler.ProfileData
        out["error"] = f"cannot read the trace: {err}"
        print(name, out["error"], flush=True)
        return out
    out["event_source"] = source
    out["kernels_per_round"] = len(events) / args.rounds
    out["device_busy_ms"] = busy_ns(events) / args.rounds / 1e6
    out["host_ms"] = out["traced_wall_ms"] - out["device_busy_ms"]
    spans = round_spans_ns(events, args.rounds)
    if spans:  # host = launch gaps between the round's kernels + dispatch / sync around them
        out["device_span_ms"] = float(np.median(spans)) / 1e6
        out["launch_gaps_ms"] = out["device_span_ms"] - out["device_busy_ms"]
        out["dispatch_sync_ms"] = out["traced_wall_ms"] - out["device_span_ms"]
    out.update(attribute(events, attr, args.rounds))
    out["listed_layer_timeline"] = timeline(events, attr, args.rounds)
    for layer, v in out["listed_layer_timeline"].items():
        print(f"  {layer} in one round: span {v['span_us']:.1f} us, kernels busy {v['busy_us']:.1f}, "
              f"idle {v['idle_us']:.1f}", flush=True)
    layers = {k: v for k, v in out["layers"].items() if k != "-"}
    out["launches_per_layer"] = {k: v["launches"] for k, v in sorted(layers.items())}
    print(name, "traced round", round(out["traced_wall_ms"], 3), "ms; device busy", round(out["device_busy_ms"], 3),
          "ms; host", round(out["host_ms"], 3), "ms;", out["kernels_per_round"], "kernels per round;", source,
          flush=True)
    print(table(out), flush=True)
    print("  phases:", {k: (round(v["ms"], 3), v["launches"]) for k, v in out["phases"].items()}, flush=True)
    for layer, comps in out["layer_components"].items():
        print(f"  {layer} launches:", {c: v["launches"] for c, v in comps.items()}, flush=True)
    return out


def profiler_trace(log_dir: str):
    """``jax.profiler.trace`` without the Python tracer (its overhead would count as host time),
    where this jax version takes profiler options."""
    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        return jax.profiler.trace(log_dir, profiler_options=opts)
    except (AttributeError, TypeError):
        return jax.profiler.trace(log_dir)


def table(res: dict) -> str:
    rows = [f"{'phase/component':26s} {'ms':>9s} {'launch':>7s} {'roof ms':>9s} {'x roof':>7s} {'MB':>10s} "
            f"{'GFLOP':>9s}"]
    keys = list(res["components"]) + [k for k in res["roofline"] if k not in res["components"]]
    for k in keys:
        m = res["components"].get(k, {"ms": 0.0, "launches": 0})
        r = res["roofline"].get(k)
        ratio = f"{m['ms'] / r['ms']:7.1f}" if r and r["ms"] > 0 else "      -"
        rows.append(f"{k:26s} {m['ms']:9.3f} {m['launches']:7.1f} {r['ms'] if r else 0:9.4f} {ratio} "
                    f"{r['MB'] if r else 0:10.2f} {r['GFLOP'] if r else 0:9.3f}")
    rows.append(f"{'host (wall - device busy)':26s} {res['host_ms']:9.3f}")
    if "launch_gaps_ms" in res:
        rows.append(f"{'  gaps between kernels':26s} {res['launch_gaps_ms']:9.3f}")
        rows.append(f"{'  dispatch + sync':26s} {res['dispatch_sync_ms']:9.3f}")
    return "\n".join(rows)


def plot(results: list[dict], path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 6), squeeze=False)
    for ax, res in zip(axes[0], results):
        keys = [k for k in res["components"] if k != "unattributed"][:16]
        meas = [res["components"][k]["ms"] for k in keys] + [res["host_ms"]]
        roof = [res["roofline"].get(k, {"ms": 0.0})["ms"] for k in keys] + [0.0]
        y = np.arange(len(keys) + 1)
        ax.barh(y - 0.2, meas, 0.4, label="measured (device)")
        ax.barh(y + 0.2, roof, 0.4, label="roofline")
        ax.set_yticks(y, keys + ["host"])
        ax.invert_yaxis()
        ax.set_xlabel("ms per round")
        ax.set_title(f"{res['mode']}: traced {res['traced_wall_ms']:.2f} ms, untraced {res['wall_ms']:.2f} ms, "
                     f"roofline {res['roofline_ms']:.2f} ms", fontsize=9)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None):
    from benchmarks.common import (add_launch_options, add_split_option, apply_launch_options,
                                   apply_split_option, ceilings, environment, out_dir,
                                   with_moe_one_row, write_json)

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=0, help="routed experts (0: Flash's 256)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default="target,dspark")
    ap.add_argument("--weights", default="fp8", choices=("official", "fp8", "dense"))
    ap.add_argument("--kv-layout", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--prefill", action="store_true", help="fill the caches by a real prefill")
    ap.add_argument("--trace-dir", default=None, help="where the raw traces go (default: a temporary folder)")
    ap.add_argument("--name", default="profile", help="output files: <name>.json and <name>.png")
    ap.add_argument("--compile-cache", default=None,
                    help="a folder for JAX's persistent compilation cache (a second run loads instead of compiling)")
    ap.add_argument("--dense-copies", action="store_true",
                    help="hold the FP8 linears also dequantised (dspark_jax.with_dense_copies)")
    ap.add_argument("--sinkhorn", default="auto", choices=("auto", "kernel", "fused"),
                    help="how mHC's steps run (Numerics.sinkhorn; fused: the hc_fused kernels)")
    ap.add_argument("--moe-one-row", default="",
                    help="comma list of MoE.one_row values (xla, select, shared, apart, experts, tile) to profile one "
                         "after the other in this process (default: the model's); results named mode[value]")
    add_launch_options(ap)
    ap.add_argument("--hlo", action="store_true", help="also write each mode's compiled HLO (<name>.<mode>.hlo.txt)")
    ap.add_argument("--smoke", action="store_true", help="tiny config, CPU-sized: checks the script runs")
    add_split_option(ap)
    args = ap.parse_args(argv)
    args.split_programs = apply_split_option(args)
    launch_options = apply_launch_options(args)
    if args.smoke:
        args.context, args.rounds, args.warmup = min(args.context, 64), min(args.rounds, 2), 1

    if args.compile_cache:
        from dspark_jax.compile_cache import enable_compile_cache

        enable_compile_cache(args.compile_cache)
    env = environment()
    print(env, flush=True)
    ceil = ceilings(0.0625, 512) if args.smoke else ceilings()
    print(ceil, flush=True)
    t0 = time.time()
    model = build(args)
    jax.block_until_ready(model.state)
    cfg = model.config
    info = {"layers": cfg.num_hidden_layers, "sinkhorn": model.numerics.sinkhorn, "split_programs": args.split_programs,
            "experts": cfg.n_routed_experts,
            "batch": args.batch, "context": args.context, "rounds": args.rounds, "weights": args.weights,
            "kv_layout": args.kv_layout, "prefill": args.prefill, "smoke": args.smoke,
            "moe_one_row": args.moe_one_row, **launch_options,
            "weight_bytes": model.weight_bytes, "init_s": time.time() - t0}
    print(info, flush=True)
    trace_root = args.trace_dir or tempfile.mkdtemp(prefix="dspark_profile_")
    results = []

    def save(partial=None):
        done = results + ([partial] if partial is not None else [])
        write_json(f"{args.name}.json", {"env": env, "ceilings": ceil, "config": info, "results": done})

    variants = args.moe_one_row.split(",") if args.moe_one_row else [None]
    base = model
    for variant in variants:
        model = base if variant is None else with_moe_one_row(base, variant)
        for mode in args.modes.split(","):
            gamma = 0 if mode == "target" else cfg.dspark.block_size
            name = mode if variant is None else f"{mode}[{variant}]"
            results.append(profile_mode(model, name, gamma, args, ceil, trace_root, save))
            save()
    for variant in variants:
        tag = "" if variant is None else f"[{variant}]"
        wall = {r["mode"]: r.get("wall_ms") for r in results}
        if wall.get("target" + tag) and wall.get("dspark" + tag):
            print(f"dspark round / target step (untraced){tag}:", round(wall["dspark" + tag] / wall["target" + tag], 3),
                  flush=True)
    profiled = [r for r in results if "components" in r]
    if profiled:
        plot(profiled, os.path.join(out_dir(), f"{args.name}.png"),
             f"{env['device']}: {cfg.num_hidden_layers} layers, batch {args.batch}, context {args.context}")
    print("wrote", os.path.join(out_dir(), f"{args.name}.json"), flush=True)


if __name__ == "__main__":
    main()
