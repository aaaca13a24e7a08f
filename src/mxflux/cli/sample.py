"""`mxflux sample`: images from a run's checkpoint or from released weights, as a PNG grid."""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path

from ..argtypes import non_negative_int, positive_int
from ..train.datacheck import warn_unknown_prompt_words
from .common import demo_root, device_from_args, json_text, trainer_from_checkpoint


def add_sample_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate images for prompts with a checkpoint or released Flux weights "
                                      "(Euler, rectified flow)",
                       description="Generate one image per prompt (Euler steps of the rectified flow, optional "
                                   "classifier-free guidance) and save them as a captioned PNG grid. The demo "
                                   "dataset decodes by itself; real prompts need --vae, --t5 and --clip.")
    p.add_argument("checkpoint", nargs="?", help="checkpoint (latest.pt, sharded latest.dcp/) or run directory")
    p.add_argument("--weights", metavar="PATH",
                   help="instead of a run checkpoint: Flux weights (BFL .safetensors, diffusers transformer/ "
                        "or pipeline folder); the model config is inferred from them unless --model is given")
    p.add_argument("--model", help="with --weights: a built-in model config the weights must fit (e.g. flux-12b)")
    p.add_argument("--lora", action="append", metavar="FILE[:SCALE]",
                   help="with --weights: a LoRA file in diffusers' layout (a LoRA run's lora.safetensors) merged "
                        "into the weights, times SCALE (default 1); repeatable")
    p.add_argument("--data", metavar="ROOT", help="with --weights and no --t5/--clip: the dataset whose own text "
                                                  "encoder (and decoder, without --vae) to use (default: the demo)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--steps", type=positive_int, default=20, help="Euler steps (default: 20)")
    p.add_argument("--shift", type=float, metavar="S",
                   help="time shift of the Euler steps towards the noise, 1 = evenly spaced (default: the "
                        "checkpoint recipe's train.sample_shift, else its train.timestep_shift; 1 with --weights)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale, 1 = none (default: the "
                                                  "checkpoint recipe's train.sample_guidance; 1 with --weights)")
    p.add_argument("--distilled-guidance", type=float, default=None, metavar="G",
                   help="the guidance input of a guidance-distilled model (FLUX.1-dev; default: the checkpoint "
                        "recipe's train.distilled_guidance; 3.5 with --weights)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the initial noise (default: 0)")
    p.add_argument("--out", default="samples.png",
                   help="PNG grid to write, or a directory for DIR/samples.png (default: samples.png)")
    p.add_argument("--no-ema", action="store_true",
                   help="draw with the checkpoint's weights, not their moving average (which a run whose recipe "
                        "sets train.ema_decay keeps and draws with by default)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"],
                   help="compute dtype (default: the checkpoint recipe's; with --weights bfloat16 on CUDA, "
                        "float32 on the CPU)")
    p.add_argument("--vae", help="a diffusers AutoencoderKL folder (or a pipeline folder with vae/) to decode with")
    for name in ("t5", "clip"):
        p.add_argument(f"--{name}", help=f"local {name.upper()} model path (give --vae, --t5 and --clip together "
                                         f"for prompts in natural language; without them the demo encoder)")
    p.add_argument("--t5-tokenizer", metavar="PATH", help="T5 tokenizer directory (default: --t5; FLUX.1: tokenizer_2/)")
    p.add_argument("--clip-tokenizer", metavar="PATH", help="CLIP tokenizer directory (default: --clip; FLUX.1: tokenizer/)")
    p.add_argument("--t5-len", type=int, help="T5 tokens per prompt (default: the dataset's; 256 with --weights, "
                                              "FLUX.1-schnell's; FLUX.1-dev takes 512)")
    p.add_argument("--height", type=int, help="image height in pixels, with --vae (default: the dataset's; 512)")
    p.add_argument("--width", type=int, help="image width in pixels, with --vae (default: the dataset's; 512)")
    p.set_defaults(handler=_sample, parser=p)


def _sample(args) -> int:
    import torch

    if (args.checkpoint is None) == (args.weights is None):
        args.parser.error("give a run checkpoint or --weights PATH, not both")
    if (args.model or args.data) and not args.weights:
        args.parser.error("--model and --data go with --weights; a run checkpoint carries its model and data")
    out = Path(args.out)
    if args.out.endswith(("/", os.sep)) or out.is_dir():
        out = out / "samples.png"
    elif out.suffix.lower() != ".png":
        args.parser.error(f"--out {args.out}: expected a .png file or a directory (for DIR/samples.png)")
    if args.lora and not args.weights:
        args.parser.error("--lora goes with --weights BASE (a LoRA run's checkpoint samples with its adapters "
                          "as it is)")
    if args.no_ema and args.weights:
        args.parser.error("--no-ema goes with a run checkpoint; --weights are drawn with as they are")
    if (args.t5 or args.clip) and not (args.vae and args.t5 and args.clip):
        args.parser.error("--t5 and --clip: give them with --vae (all three), or none for the demo encoder")
    if args.weights:
        from ..data import LatentDataset
        from ..model import FluxWeightsError, flux_config, flux_from_checkpoint
        from ..train.distributed import alone

        device = device_from_args(args) or alone().device
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda"
                                                                 else torch.float32)
        try:
            config = flux_config(args.model) if args.model else None
            model = flux_from_checkpoint(args.weights, config, device=device, dtype=dtype)
        except (FluxWeightsError, ValueError) as e:
            args.parser.error(f"--weights: {e}")
        for spec in args.lora or ():
            _merge_lora_file(model, spec, args.parser)
        # Without real text encoders, prompts go through a dataset's own (the demo's) encoder.
        dataset = None if args.t5 else LatentDataset(args.data or demo_root(args), "train")
        default_guidance, default_shift, trained_distilled = 1.0, 1.0, None
        weights = contextlib.nullcontext()
    else:
        trainer = trainer_from_checkpoint(args)
        model, dataset, device = trainer.model, trainer.train_set, trainer.device
        dtype = getattr(torch, args.dtype) if args.dtype else trainer.compute_dtype
        default_guidance, default_shift = trainer.cfg.train.sample_guidance, trainer.cfg.train.sampler_shift
        trained_distilled = trainer.cfg.train.distilled_guidance
        weights = contextlib.nullcontext() if args.no_ema else trainer.sampling_weights()
    guidance = default_guidance if args.guidance is None else args.guidance
    if guidance < 0:
        args.parser.error(f"--guidance: expected a scale >= 0, got {guidance}")
    time_shift = default_shift if args.shift is None else args.shift
    if time_shift <= 0:
        args.parser.error(f"--shift: expected a shift > 0, got {time_shift}")
    from ..train.guidance import sampling_distilled_guidance

    try:
        distilled = sampling_distilled_guidance(model.config.guidance_embed, args.distilled_guidance, trained_distilled)
    except ValueError as e:
        args.parser.error(str(e))

    encoders = vae = None
    if args.t5:
        from ..data.prepare import _Encoders

        t5_len = args.t5_len or (dataset.t5_shape[0] if dataset is not None else 256)
        encoders = _Encoders(vae_path=args.vae, t5_path=args.t5, clip_path=args.clip,
                             t5_tokenizer_path=args.t5_tokenizer, clip_tokenizer_path=args.clip_tokenizer,
                             t5_len=t5_len, device=device, dtype=dtype)
    elif args.vae:
        from ..train.sample import VaeDecoder

        vae = VaeDecoder.from_pretrained(args.vae, device=device, dtype=dtype)
    size = None
    if args.height or args.width:
        if not args.vae:
            args.parser.error("--height/--width: the image size is set with --vae (else the dataset's)")
        size = (args.height or args.width, args.width or args.height)
    elif args.vae and dataset is None:
        size = (512, 512)
    try:
        with weights:
            grid = sample_to_grid(model, dataset, args.prompt, steps=args.steps, seed=args.seed,
                                   out=out, dtype=dtype, encoders=encoders, guidance=guidance, vae=vae,
                                   image_size=size, distilled_guidance=distilled,
                                   time_shift=time_shift)
    except ValueError as e:
        args.parser.error(str(e))
    if grid is None:
        args.parser.error("this dataset has no built-in decoder: pass --vae, --t5 and --clip")
    print(json_text({"samples": str(grid), "prompts": args.prompt}))
    return 0


def _merge_lora_file(model, spec: str, parser) -> None:
    """Merge `FILE[:SCALE]` into `model`'s weights (one linear's update at a time)."""
    from ..model.lora_file import LoRAFileError, load_lora_deltas
    from ..nn.lora import add_deltas

    path, scale = spec, 1.0
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            path, scale = head, float(tail)
        except ValueError:
            path = spec  # a ':' in the path itself
    if not Path(path).is_file():
        parser.error(f"--lora {spec}: no such file")
    try:
        add_deltas(model, load_lora_deltas(path, model.config, scale))
    except (LoRAFileError, ValueError) as e:
        parser.error(f"--lora {spec}: {e}")


def sample_to_grid(model, dataset, prompts, *, steps, seed, out, dtype, encoders=None, guidance=1.0, vae=None,
                    image_size=None, distilled_guidance=None, time_shift=1.0):
    """Encode prompts, sample latents, decode and save a grid; None if no decoder is known.

    Text: `encoders` (real T5 and CLIP), else the dataset's own encoder (the demo's). Decoder and
    latent geometry: a VAE (`encoders.vae` or `vae`; `image_size` pixels, default the dataset's
    latent size), else the dataset's built-in decoder.
    """
    from ..data import load_empty_encodings

    from ..train.sample import VaeDecoder, generate_latents, save_grid

    if encoders is not None:
        encode = encoders.captions
        vae = VaeDecoder(encoders.vae, device=encoders.device, dtype=encoders.dtype)
    else:
        source = dataset.meta.source
        if source.get("kind") != "demo" and not source.get("decoder"):
            return None
        from ..data import encode_demo_prompts as encode

        warn_unknown_prompt_words(prompts)

    if vae is not None:
        if image_size is None:
            latent = dataset.latent_shape[1:]
            image_size = (latent[0] * vae.downsample, latent[1] * vae.downsample)
        latent_shape = vae.latent_shape(*image_size)
        shift, scale, decode = vae.latent_shift, vae.latent_scale, vae.decode
    else:
        module, _, fn = dataset.meta.source["decoder"].rpartition(".")
        latent_shape, shift, scale = dataset.latent_shape, dataset.latent_shift, dataset.latent_scale
        decode = getattr(importlib.import_module(module), fn)
    in_channels = model.config.in_channels
    if 4 * latent_shape[0] != in_channels:
        raise ValueError(f"the decoder's latents have {latent_shape[0]} channels; this model takes "
                         f"{in_channels // 4} (in_channels {in_channels} = 4 x latent channels)")

    t5, clip = encode(prompts)
    if (t5.shape[-1], clip.shape[-1]) != (model.config.context_in_dim, model.config.vec_in_dim):
        raise ValueError(f"the text encodings are T5 {t5.shape[-1]} / CLIP {clip.shape[-1]} wide; this model "
                         f"takes {model.config.context_in_dim} / {model.config.vec_in_dim}: pass --vae, --t5 and "
                         f"--clip (FLUX.1: text_encoder_2/, text_encoder/)")
    empty = None
    if guidance != 1.0:  # the empty prompt: the dataset's own encodings (what CFG dropout trained on)
        if dataset is not None:
            empty = load_empty_encodings(dataset.root)
        else:
            t5_empty, clip_empty = encode([""])
            empty = (t5_empty[0], clip_empty[0])
    z = generate_latents(model, t5, clip, latent_shape=latent_shape, steps=steps, seed=seed, shift=shift,
                         scale=scale, dtype=dtype, guidance=guidance, empty=empty,
                         distilled_guidance=distilled_guidance, time_shift=time_shift)
    images = decode(z if vae is not None else z.cpu())
    return save_grid(images.cpu(), out, captions=list(prompts))
