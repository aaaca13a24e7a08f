"""`mxflux data ...`: build, inspect and benchmark datasets (docs/DATA_FORMAT.md).

`add_data_parser(subparsers)` registers `data` with its subcommands synth, prepare, demo, info and
bench. Parsing uses only the standard library; each handler imports what it needs when it runs,
so `mxflux --help` never loads torch. A handler's `DataError` (bad input or dataset: the message
names it) is reported like an argparse error: usage, message, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..argtypes import non_negative_int, positive_int

__all__ = ["add_data_parser"]


def add_data_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `data` and its subcommands to the `mxflux` command's subparsers."""
    data = subparsers.add_parser(
        "data", help="build, inspect and benchmark training datasets",
        description="Datasets in the mxflux latent format: precomputed VAE latent distributions and "
                    "T5/CLIP text encodings in safetensors shards (docs/DATA_FORMAT.md).")
    sub = data.add_subparsers(title="data commands", metavar="COMMAND")

    def no_subcommand(args: argparse.Namespace) -> int:
        data.print_help(sys.stderr)
        return 2

    data.set_defaults(handler=no_subcommand)

    p = sub.add_parser("synth", help="write a random dataset that fits a recipe's model (smoke runs, benchmarks)",
                       description="Write a dataset of random tensors with realistic statistics. With --for "
                                   "RECIPE its widths are the recipe's model's (T5 = context_in_dim, CLIP = "
                                   "vec_in_dim, latent channels = in_channels / 4) and its sizes the recipe's "
                                   "data's (the demo dataset's T5 32 and latent 16 for the tiny recipes, else "
                                   "MLPerf's 256 and 32). Without it: the MLPerf dims (T5 256x4096, CLIP 768, "
                                   "latent 16x32x32), which fit the flux-535m and flux12b recipes only.")
    p.add_argument("--for", dest="recipe", metavar="RECIPE",
                   help="write data that fits this recipe (a built-in name or a YAML file)")
    p.add_argument("--out", required=True, metavar="DIR", help="new dataset directory (must not hold files)")
    p.add_argument("--train", type=non_negative_int, required=True, metavar="N", help="training samples")
    p.add_argument("--eval", type=non_negative_int, required=True, metavar="N", help="evaluation samples")
    p.add_argument("--t5-len", type=positive_int, metavar="L", help="T5 tokens (default: 256, or as --for's data)")
    p.add_argument("--t5-dim", type=positive_int, metavar="D", help="T5 width (default: 4096; with --for: its model's)")
    p.add_argument("--clip-dim", type=positive_int, metavar="D",
                   help="CLIP width (default: 768; with --for: its model's)")
    p.add_argument("--latent-size", type=positive_int, metavar="HW",
                   help="latent height = width (default: 32, or as --for's data)")
    p.add_argument("--shard-size", type=positive_int, metavar="N", help="samples per shard (default: ~1 GiB shards)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.set_defaults(handler=_synth, parser=p)

    p = sub.add_parser("prepare", help="encode captioned images with a VAE, T5 and CLIP",
                       description="Encode images (.png/.jpg/.jpeg/.webp, each with a same-stem .txt "
                                   "caption beside it) with a diffusers AutoencoderKL, a transformers "
                                   "T5EncoderModel and CLIPTextModel, loaded from local directories. "
                                   "Needs the 'prepare' extra.")
    p.add_argument("--images", required=True, metavar="DIR", help="training images (searched recursively)")
    p.add_argument("--out", required=True, metavar="DIR", help="new dataset directory (must not hold files)")
    p.add_argument("--vae", required=True, metavar="PATH", help="AutoencoderKL directory (FLUX.1: vae/)")
    p.add_argument("--t5", required=True, metavar="PATH", help="T5 encoder directory (FLUX.1: text_encoder_2/)")
    p.add_argument("--clip", required=True, metavar="PATH", help="CLIP text model directory (FLUX.1: text_encoder/)")
    p.add_argument("--t5-tokenizer", metavar="PATH",
                   help="T5 tokenizer directory (default: --t5; FLUX.1: tokenizer_2/)")
    p.add_argument("--clip-tokenizer", metavar="PATH",
                   help="CLIP tokenizer directory (default: --clip; FLUX.1: tokenizer/)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--eval-images", metavar="DIR", help="evaluation images (default: --num-eval held out)")
    split.add_argument("--num-eval", type=non_negative_int, default=0, metavar="N",
                       help="hold out the last N training images (sorted by path) as the eval split")
    p.add_argument("--t5-len", type=positive_int, default=256, metavar="L", help="T5 tokens (default: 256)")
    p.add_argument("--image-size", type=positive_int, default=256, metavar="PX", help="square image side (default: 256)")
    p.add_argument("--batch-size", type=positive_int, default=16, metavar="N",
                   help="images per encoder batch (default: 16)")
    p.add_argument("--device", default="cpu", help="encoder device, e.g. cuda or cpu (default: cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="encoder compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--shard-size", type=positive_int, metavar="N", help="samples per shard (default: ~1 GiB shards)")
    p.set_defaults(handler=_prepare, parser=p)

    p = sub.add_parser("demo", help="build the built-in demo dataset of captioned shapes",
                       description="Build the demo dataset: 64x64 images of coloured shapes with captions, "
                                   "encoded by an exact pixel 'VAE' and hashed word embeddings (for flux-tiny).")
    p.add_argument("--out", required=True, metavar="DIR", help="new dataset directory (must not hold files)")
    p.add_argument("--train", type=non_negative_int, default=2048, metavar="N", help="training samples (default: 2048)")
    p.add_argument("--eval", type=non_negative_int, default=256, metavar="N", help="evaluation samples (default: 256)")
    p.add_argument("--seed", type=int, default=0, help="scene seed (default: 0)")
    p.set_defaults(handler=_demo, parser=p)

    p = sub.add_parser("info", help="check a dataset and summarise it",
                       description="Check meta.json and every shard header, then print a summary.")
    p.add_argument("root", metavar="DIR", help="dataset directory")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=_info, parser=p)

    p = sub.add_parser("bench", help="measure loader throughput (samples/s) on a dataset",
                       description="Iterate a split with build_loader and report samples/s, after "
                                   "warm-up batches. Run it twice to see page-cache-warm numbers.")
    p.add_argument("root", metavar="DIR", help="dataset directory")
    p.add_argument("--split", default="train", help="split to read (default: train)")
    p.add_argument("--batch-size", type=positive_int, default=32, metavar="N", help="batch size (default: 32)")
    p.add_argument("--workers", type=non_negative_int, default=2, metavar="N", help="DataLoader workers (default: 2)")
    p.add_argument("--prefetch", type=positive_int, default=4, metavar="N", help="prefetch factor (default: 4)")
    p.add_argument("--warmup", type=non_negative_int, default=4, metavar="N", help="batches not timed (default: 4)")
    p.add_argument("--pin-memory", action="store_true", help="pin batches (as a CUDA trainer does)")
    p.add_argument("--device", help="also copy each batch to this device, e.g. cuda")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=_bench, parser=p)
    return data


def _run(args: argparse.Namespace, fn) -> int:
    from ..data.shards import DataError

    try:
        return fn()
    except DataError as e:
        args.parser.error(str(e))  # exits 2


def _synth_dims(args: argparse.Namespace):
    """The dims `data synth` writes: --for's recipe's (its model's widths, its data's sizes), or the
    MLPerf dims; explicit sizes replace either."""
    from ..data.fit import DataDims, demo_dims, dims_for_model

    if args.recipe is None:
        return DataDims(l_txt=args.t5_len or 256, d_t5=args.t5_dim or 4096, d_clip=args.clip_dim or 768,
                        latent_channels=16, latent_hw=args.latent_size or 32)
    for flag, value in (("--t5-dim", args.t5_dim), ("--clip-dim", args.clip_dim)):
        if value is not None:
            args.parser.error(f"{flag}: --for {args.recipe} takes it from the recipe's model; give one of them")
    from ..train.config import RecipeError, load_recipe  # a CLI handler: it may read a recipe

    try:
        cfg = load_recipe(args.recipe)
    except RecipeError as e:
        args.parser.error(str(e))
    sizes = demo_dims() if cfg.data.root is None else None
    return dims_for_model(cfg.model.flux_config(),
                          l_txt=args.t5_len or (sizes.l_txt if sizes else 256),
                          latent_hw=args.latent_size or (sizes.latent_hw if sizes else 32))


def _synth(args: argparse.Namespace) -> int:
    def go() -> int:
        from dataclasses import asdict

        from ..data.synth import write_synthetic

        dims = _synth_dims(args)
        out = write_synthetic(args.out, n_train=args.train, n_eval=args.eval, **asdict(dims),
                              seed=args.seed, samples_per_shard=args.shard_size)
        print(f"wrote {args.train} train + {args.eval} eval random samples ({dims.describe()}) to {out}"
              + (f"; train on it: mxflux train {args.recipe} --set data.root={out}" if args.recipe else ""))
        return 0

    return _run(args, go)


def _prepare(args: argparse.Namespace) -> int:
    def go() -> int:
        import logging

        import torch

        from ..data.prepare import prepare_dataset

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        out = prepare_dataset(args.images, args.out, vae_path=args.vae, t5_path=args.t5, clip_path=args.clip,
                              t5_tokenizer_path=args.t5_tokenizer, clip_tokenizer_path=args.clip_tokenizer,
                              t5_len=args.t5_len, image_size=args.image_size, batch_size=args.batch_size,
                              device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None,
                              eval_dir=args.eval_images, num_eval=args.num_eval,
                              samples_per_shard=args.shard_size)
        print(f"wrote {out}")
        return 0

    return _run(args, go)


def _demo(args: argparse.Namespace) -> int:
    def go() -> int:
        from ..data.demo import build_demo_dataset

        out = build_demo_dataset(args.out, n_train=args.train, n_eval=args.eval, seed=args.seed)
        print(f"wrote the demo dataset ({args.train} train + {args.eval} eval) to {out}")
        return 0

    return _run(args, go)


def _summary(root: str) -> dict:
    from pathlib import Path

    from ..data.shards import LatentDataset, read_meta

    meta = read_meta(root)
    splits = {}
    for name, split in meta.splits.items():
        ds = LatentDataset(root, name)  # checks every shard header
        on_disk = sum((Path(root) / f).stat().st_size for f, _ in split.shards)
        splits[name] = {
            "num_samples": len(ds), "shards": len(split.shards), "bytes_per_sample": ds.bytes_per_sample,
            "bytes_on_disk": on_disk, "captions": split.captions is not None,
            "tensors": {k: {"shape": list(s.shape), "dtype": s.dtype} for k, s in split.tensors.items()},
        }
    return {"root": str(root), "format_version": meta.raw["format_version"],
            "latent": {"shift": meta.latent_shift, "scale": meta.latent_scale},
            "splits": splits, "source": meta.source}


def _info(args: argparse.Namespace) -> int:
    def go() -> int:
        s = _summary(args.root)
        if args.json:
            from ..data.shards import format_json

            print(format_json(s))
            return 0
        print(f"{s['root']}: mxflux latent dataset, format version {s['format_version']}, "
              f"source {s['source'].get('kind', 'unknown')}")
        print(f"  latent normalisation (z - {s['latent']['shift']}) * {s['latent']['scale']}")
        for name, sp in s["splits"].items():
            print(f"  {name}: {sp['num_samples']} samples in {sp['shards']} shards, "
                  f"{sp['bytes_per_sample'] / 2**20:.3f} MiB/sample, {sp['bytes_on_disk'] / 2**30:.3f} GiB"
                  f"{', with captions' if sp['captions'] else ''}")
            for k, t in sp["tensors"].items():
                print(f"    {k:15s} {str(t['shape']):18s} {t['dtype']}")
        return 0

    return _run(args, go)


def _bench(args: argparse.Namespace) -> int:
    def go() -> int:
        import os
        import time

        import torch

        from ..data.loader import build_loader
        from ..data.shards import LatentDataset

        ds = LatentDataset(args.root, args.split)
        loader = build_loader(ds, batch_size=args.batch_size, num_workers=args.workers,
                              prefetch_factor=args.prefetch, pin_memory=args.pin_memory, seed=0, epoch=0)
        if len(loader) <= args.warmup:
            from ..data.shards import DataError

            raise DataError(f"{args.split} has {len(loader)} batches of {args.batch_size}: need more "
                            f"than --warmup {args.warmup}")
        def sync() -> None:
            if args.device and torch.device(args.device).type == "cuda":
                torch.cuda.synchronize()

        samples, start = 0, time.perf_counter()
        for i, batch in enumerate(loader):
            if args.device:
                batch = {k: v.to(args.device, non_blocking=True) for k, v in batch.items()}
            if i < args.warmup:  # timing starts once the last warm-up batch is in
                sync()
                start = time.perf_counter()
                continue
            samples += batch["index"].shape[0]
        sync()
        seconds = time.perf_counter() - start
        result = {"samples_per_s": samples / seconds, "samples": samples, "seconds": seconds,
                  "batch_size": args.batch_size, "workers": args.workers, "pin_memory": args.pin_memory,
                  "device": args.device, "bytes_per_sample": ds.bytes_per_sample,
                  "cpus": os.cpu_count(), "load_avg_1min": os.getloadavg()[0]}
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{result['samples_per_s']:.0f} samples/s ({samples} samples in {seconds:.2f} s; "
                  f"{result['samples_per_s'] * ds.bytes_per_sample / 2**30:.2f} GiB/s; batch {args.batch_size}, "
                  f"{args.workers} workers, {os.cpu_count()} CPUs, load {result['load_avg_1min']:.1f})")
        return 0

    return _run(args, go)
