"""``python -m dspark_jax.train <out_dir> [--minutes M] [--toy]``"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.train",
                                description="Train the small DeepSeek-V4 + DSpark pair and export it in the "
                                            "official checkpoint layout under <out_dir>/model.")
    p.add_argument("out_dir")
    p.add_argument("--minutes", type=float, default=None,
                   help="wall-clock budget of the whole run (default: 7 for the shipped preset)")
    p.add_argument("--toy", action="store_true", help="CPU-test scale (a few steps of each phase)")
    p.add_argument("--target-share", type=float, default=None, help="share of the training time for the target")
    p.add_argument("--target-batch", type=int, default=None, help="windows per target step")
    p.add_argument("--drafter-batch", type=int, default=None, help="windows per drafter step")
    p.add_argument("--stages", type=int, default=None, help="DSpark drafter stages (default 3; toy 2)")
    p.add_argument("--target-layers", default=None,
                   help="comma-separated target layers whose hc-means feed the drafter (default: the last 3)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default) or float32")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--work-dir", default=None,
                   help="token cache and training checkpoints (default <out_dir>/work)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in the work directory")
    args = p.parse_args(argv)

    import dataclasses

    from dspark_jax.train.config import shipped, toy
    from dspark_jax.train.run import train_all

    cfg = toy() if args.toy else shipped()
    changes = {}
    if args.minutes is not None:
        changes["minutes"] = args.minutes
    if args.target_share is not None:
        changes["target_share"] = args.target_share
    if args.dtype is not None:
        changes["dtype"] = args.dtype
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.target_batch is not None:
        changes["target"] = dataclasses.replace(cfg.target, batch_size=args.target_batch)
    if args.drafter_batch is not None:
        changes["drafter"] = dataclasses.replace(cfg.drafter, batch_size=args.drafter_batch)
    ds = cfg.model.dspark
    if args.stages is not None:
        ds = dataclasses.replace(ds, num_stages=args.stages)
    if args.target_layers is not None:
        ds = dataclasses.replace(ds, target_layer_ids=tuple(int(x) for x in args.target_layers.split(",")))
    if ds != cfg.model.dspark:
        changes["model"] = cfg.model.replace(dspark=ds)
    cfg = cfg.replace(**changes)
    log = train_all(args.out_dir, cfg, work_dir=args.work_dir, resume=not args.no_resume)
    print(f"done in {log['timings']['total_s']:.0f} s: {args.out_dir}/model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
