"""A Markdown summary of a training run from its JSON log (for ``docs/tiny_model.md``).

``python -m dspark_jax.train.report train_log.json``"""

from __future__ import annotations

import json
import math
import sys


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _f(x, nd=3) -> str:
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def summarize(log: dict) -> str:
    c, t, d, s = log["corpus"], log["target"], log["drafter"], log["sts"]
    tp, dp = t["phase"], d["phase"]
    tim, n = log["timings"], log["parameters"]
    bits_per_byte = t["heldout"]["loss"] / math.log(2) / c["bytes_per_token"]  # train-split bytes per token
    lines = [
        "### Run",
        "",
        _row("device", "budget", "wall time", "data", "target phase", "generation", "drafter phase",
             "evaluation + STS + export"),
        _row("---", "---", "---", "---", "---", "---", "---", "---"),
        _row(log["device"], f"{log['minutes']} min", f"{tim['total_s']:.0f} s", f"{tim['data_s']:.0f} s",
             f"{tim['target_s']:.0f} s (first step {tp['compile_s']:.0f} s)",
             f"{tim['generate_s']:.0f} s" if "generate_s" in tim else "none",
             f"{tim['drafter_s']:.0f} s (first step {dp['compile_s']:.0f} s)", f"{tim['finish_s']:.0f} s"),
        "",
        *_compile_lines(log),
        f"Corpus: {c['train_files']} train / {c['heldout_files']} held-out files of `{c['root']}` "
        f"({c['train_bytes'] / 1e6:.1f} MB / {c['heldout_bytes'] / 1e6:.2f} MB), {c['train_tokens']:,} train tokens, "
        f"{c['bytes_per_token']:.2f} bytes per token, vocabulary {c['tokenizer_vocab']}.",
        *([f"Pinned packages in the training split: {c['package_files']} files, {c['package_bytes'] / 1e6:.1f} MB ("
           + ", ".join(f"{k} {v}" for k, v in c["packages"].items()) + ")."] if c.get("packages") else []),
        f"Parameters: target {n['target'] / 1e6:.2f} M, drafter {n['drafter'] / 1e6:.2f} M; "
        f"files {log['total_mib']:.2f} MiB: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in log["files"].items()),
        "",
        "### Training",
        "",
        _row("phase", "steps", "batch (windows)", "tokens", "epochs", "tokens/s", "held-out"),
        _row("---", "---", "---", "---", "---", "---", "---"),
        _row("target", tp["steps"], tp["batch_size"], f"{tp['tokens']:,}", _f(tp["epochs"], 2),
             f"{tp['tokens_per_s']:,.0f}",
             f"loss {t['heldout']['loss']:.3f} nats/token ({bits_per_byte:.3f} bits/byte), "
             f"accuracy {t['heldout']['accuracy']:.3f}"),
        _row("drafter", dp["steps"], dp["batch_size"], f"{dp['tokens']:,}", _f(dp["epochs"], 2),
             f"{dp['tokens_per_s']:,.0f}",
             f"tau_greedy {d['heldout']['tau_greedy']:.3f}, tau_prob {d['heldout']['tau_prob']:.3f} (teacher-forced)"),
        "",
        *_generation_lines(log),
        "### Held-out acceptance by draft position (teacher-forced)",
        "",
        _row("k", "greedy match", "greedy conditional acceptance", "greedy survival", "mean c*_k (T = 1)"),
        _row("---", "---", "---", "---", "---"),
    ]
    h = d["heldout"]
    for k in range(len(h["match"])):
        lines.append(_row(k + 1, _f(h["match"][k]), _f(h["conditional_accept_greedy"][k]),
                          _f(h["survival_greedy"][k]), _f(h["accept_prob"][k])))
    lines += [
        "",
        "### Confidence calibration (STS)",
        "",
        _row("k", "temperature", "ECE before", "ECE after", "AUC before", "AUC after"),
        _row("---", "---", "---", "---", "---", "---"),
    ]
    for k in range(len(s["ece_before_per_position"])):
        lines.append(_row(k + 1, _f(s["temperatures"][k]), _f(s["ece_before_per_position"][k], 4),
                          _f(s["ece_after_per_position"][k], 4), _f(s["auc_before_per_position"][k]),
                          _f(s["auc_after_per_position"][k])))
    lines += ["", f"Mean ECE on the evaluation half: {s['ece_before']:.4f} -> {s['ece_after']:.4f} "
                  f"({s['blocks']} blocks). Labels: {s.get('labels', 'teacher-forced held-out blocks')}."]
    return "\n".join(lines)


def _compile_lines(log: dict) -> list[str]:
    """Each program's compilation: ahead (in a background thread) or in place, and how much of it
    the run waited for."""
    if "compile" not in log:
        return []
    lines = [_row("program", "compiled", "compile", "first call waited", "overlapped"), _row(*["---"] * 5)]
    for name, p in log["compile"].items():
        how = "ahead" if p["ahead"] else "in place"
        if p.get("background"):
            how += ", background"
        if p.get("options", {}) and p["options"].get("xla_gpu_autotune_level") == 0:
            how += ", no autotuning"
        if p.get("options_error"):
            how += ", options dropped (see the log)"
        lines.append(_row(name, how, f"{_f(p['compile_s'], 1)} s", f"{_f(p['waited_s'], 1)} s",
                          f"{_f(p['overlapped_s'], 1)} s"))
    st = log["target"].get("step_s")
    if st and st["steps_other"] + st["steps_during_compiles"]:
        lines += ["", f"Target step time (median): {_f(st['median_during_compiles'])} s over "
                      f"{st['steps_during_compiles']} steps while programs compiled in the background, "
                      f"{_f(st['median_other'])} s over {st['steps_other']} other steps."]
    return lines + [""]


def _generation_lines(log: dict) -> list[str]:
    """The generated drafter data and the replayed decoding rounds (runs with a generation phase)."""
    if "generate" not in log:
        return []
    g, dec = log["generate"], log["drafter"].get("decoding")
    greedy = g.get("greedy_fraction", 0.5)
    lines = [f"Drafter data: {g['sequences']} sequences generated by the target (prompts of {g['prefix_tokens']} "
             f"tokens + {g['new_tokens']} generated, {greedy:.0%} greedy, the others sampled at T = 1; "
             f"{g['generated_tokens']:,} tokens at {g['tokens_per_s']:,.0f} tokens/s, first batch "
             f"{g['first_batch_s']:.0f} s) in {g['generated_windows']} windows, plus {g['corpus_windows']} corpus "
             f"windows.", ""]
    if dec:
        lines += [f"Held-out decoding, replayed greedy rounds on {dec['sequences']} greedy continuations of held-out "
                  f"prompts: accept length **{dec['mean_accept_length']:.3f}** ({dec['rounds']} rounds), "
                  "conditional acceptance by position "
                  + ", ".join(_f(x, 2) for x in dec["per_position_acceptance"]) + ".", ""]
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dspark_jax.train.report train_log.json")
    with open(sys.argv[1]) as f:
        print(summarize(json.load(f)))
