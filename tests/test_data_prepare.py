"""`prepare_dataset` with tiny, randomly initialised models built and saved here (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("PIL")

from PIL import Image  # noqa: E402

from mxflux.data.prepare import find_captioned_images, prepare_dataset  # noqa: E402
from mxflux.data.shards import DataError, LatentDataset, load_empty_encodings  # noqa: E402

WORDS = "a the red green blue yellow circle square triangle at top bottom left right center in on and small large"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A word-level tokenizer, a 1-layer T5 encoder and CLIP text model, a 4-level 16-channel VAE."""
    from diffusers import AutoencoderKL
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

    root = tmp_path_factory.mktemp("models")
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS.split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=24, d_kv=8, d_ff=48, num_layers=1, num_heads=3,
                            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).save_pretrained(root / "t5")
    CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=77, pad_token_id=0, bos_token_id=1,
                                 eos_token_id=1)).save_pretrained(root / "clip")
    AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 8, 8),
                  down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                  layers_per_block=1, norm_num_groups=4, sample_size=32, shift_factor=0.1159,
                  scaling_factor=0.3611).save_pretrained(root / "vae")
    return root


@pytest.fixture
def images(tmp_path, gen):
    """7 captioned images of odd sizes and formats, some in a subdirectory."""
    from mxflux.data.demo import demo_caption, render_demo_images, sample_demo_scenes

    root = tmp_path / "images"
    (root / "more").mkdir(parents=True)
    scenes = sample_demo_scenes(7, int(torch.randint(0, 2**31, (1,), generator=gen)))
    for i, (scene, img) in enumerate(zip(scenes, render_demo_images(scenes))):
        path = (root / "more" if i >= 4 else root) / f"img{i}.{'jpg' if i % 3 == 0 else 'png'}"
        pixels = (img * 255).round().byte().permute(1, 2, 0).numpy()
        Image.fromarray(pixels).resize((48 + 8 * i, 40)).save(path)
        path.with_suffix(".txt").write_text(demo_caption(scene) + "\n")
    return root


def test_prepare_with_tiny_local_models(models, images, tmp_path):
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    from mxflux.data.prepare import _load_image

    out = tmp_path / "prepared"
    prepare_dataset(images, out, vae_path=models / "vae", t5_path=models / "t5", clip_path=models / "clip",
                    t5_tokenizer_path=models / "tokenizer", clip_tokenizer_path=models / "tokenizer",
                    t5_len=12, image_size=32, batch_size=3, num_eval=2)
    train, ev = LatentDataset(out, "train"), LatentDataset(out, "eval")
    assert (len(train), len(ev)) == (5, 2)
    assert train.latent_shape == (16, 4, 4) and train.t5_shape == (12, 24) and train.clip_dim == 16
    assert (train.latent_shift, train.latent_scale) == (0.1159, 0.3611)  # the VAE config's facts
    assert [int(ev[i]["timestep_index"]) for i in range(2)] == [0, 1]

    # What is stored is what the models give, rounded to bf16.
    pairs = find_captioned_images(images)
    assert train.captions() + ev.captions() == [c for _, c in pairs]
    vae = AutoencoderKL.from_pretrained(models / "vae").eval()
    tok = AutoTokenizer.from_pretrained(models / "tokenizer")
    t5 = T5EncoderModel.from_pretrained(models / "t5").eval()
    clip = CLIPTextModel.from_pretrained(models / "clip").eval()
    with torch.no_grad():
        pixels = torch.stack([_load_image(p, 32) for p, _ in pairs])
        dist = vae.encode(pixels).latent_dist
        captions = [c for _, c in pairs] + [""]
        t5_out = t5(input_ids=tok(captions, padding="max_length", max_length=12, truncation=True,
                                  return_tensors="pt").input_ids).last_hidden_state
        clip_out = clip(input_ids=tok(captions, padding="max_length", max_length=77, truncation=True,
                                      return_tensors="pt").input_ids).pooler_output
    stored = {k: torch.cat([train.gather(range(5))[k], ev.gather(range(2))[k]])
              for k in ("vae_mean", "vae_logvar", "t5", "clip")}
    # Batches of 3 vs 7 at once: allow fp32 summation-order noise, then bf16 rounding.
    for name, ref in (("vae_mean", dist.mean), ("vae_logvar", dist.logvar), ("t5", t5_out[:7]),
                      ("clip", clip_out[:7])):
        torch.testing.assert_close(stored[name].float(), ref.bfloat16().float(), atol=1e-2, rtol=1e-2, msg=name)
    t5_empty, clip_empty = load_empty_encodings(out)
    torch.testing.assert_close(t5_empty.float(), t5_out[7].bfloat16().float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(clip_empty.float(), clip_out[7].bfloat16().float(), atol=1e-2, rtol=1e-2)
    assert pixels.shape == (7, 3, 32, 32) and pixels.min() >= -1 and pixels.max() <= 1


def test_prepare_with_a_separate_eval_directory(models, images, tmp_path):
    out = tmp_path / "prepared"
    prepare_dataset(images / "more", out, eval_dir=images, vae_path=models / "vae", t5_path=models / "t5",
                    clip_path=models / "clip", t5_tokenizer_path=models / "tokenizer",
                    clip_tokenizer_path=models / "tokenizer", t5_len=8, image_size=16, batch_size=8)
    assert len(LatentDataset(out, "train")) == 3 and len(LatentDataset(out, "eval")) == 7
    assert LatentDataset(out, "eval").latent_shape == (16, 2, 2)
    assert [int(LatentDataset(out, "eval")[i]["timestep_index"]) for i in range(7)] == list(range(7))


def test_missing_caption_is_named(images):
    (images / "img2.txt").unlink()
    with pytest.raises(DataError, match=r"img2.png has no caption file img2.txt"):
        find_captioned_images(images)


def test_no_images_and_existing_output(models, tmp_path, images):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no images"):
        find_captioned_images(tmp_path / "empty")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(DataError, match="never overwrites"):
        prepare_dataset(images, tmp_path / "taken", vae_path=models / "vae", t5_path=models / "t5",
                        clip_path=models / "clip")


def test_train_and_sample_with_the_real_encoder_path(models, images, tmp_path, monkeypatch, capsys):
    """A dataset from `data prepare` → `mxflux train` → `mxflux sample --vae --t5 --clip`: prompts go
    through the T5/CLIP models, the sampled latents through the VAE decoder, into the PNG grid."""
    import json

    from mxflux.cli import main
    from mxflux.data.prepare import _Encoders
    from mxflux.train import sample as sample_module
    from mxflux.cli.common import trainer_from_checkpoint

    data, run = tmp_path / "prepared", tmp_path / "run"
    prepare_dataset(images, data, vae_path=models / "vae", t5_path=models / "t5", clip_path=models / "clip",
                    t5_tokenizer_path=models / "tokenizer", clip_tokenizer_path=models / "tokenizer",
                    t5_len=12, image_size=32, batch_size=4, num_eval=2)
    sets = [f"data.root={data}", "data.num_workers=0", "model.overrides={context_in_dim: 24, vec_in_dim: 16}",
            "batch.global_batch_size=2", "batch.micro_batch_size=2", "train.train_samples=4",
            "train.eval_every_samples=4", "train.eval_samples=2", "train.eval_batch_size=2",
            "train.sample_prompts=[]"]
    assert main(["train", "tiny-bf16", "--device", "cpu", "--out", str(run), "--no-progress",
                 *[a for s in sets for a in ("--set", s)]]) == 0

    grids = []
    real_save_grid = sample_module.save_grid
    monkeypatch.setattr(sample_module, "save_grid", lambda images, *a, **kw: (grids.append(images),
                                                                              real_save_grid(images, *a, **kw))[1])
    prompts = ["a red circle at the top", "a small blue square"]
    enc_args = ["--vae", str(models / "vae"), "--t5", str(models / "t5"), "--clip", str(models / "clip"),
                "--t5-tokenizer", str(models / "tokenizer"), "--clip-tokenizer", str(models / "tokenizer")]
    capsys.readouterr()
    assert main(["sample", str(run), "--device", "cpu", "--steps", "3", "--seed", "5", "--out",
                 str(tmp_path / "grid.png"), *[a for p in prompts for a in ("--prompt", p)], *enc_args]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompts"] == prompts
    with Image.open(tmp_path / "grid.png") as im:
        assert im.width > 100 and im.height > 100

    # The grid holds exactly VAE.decode(Euler samples of the trained model for the encoded prompts),
    # guided and time-shifted as the recipe says, against the dataset's empty encodings.
    import argparse

    trainer = trainer_from_checkpoint(argparse.Namespace(checkpoint=str(run), device="cpu", parser=None))
    guidance, time_shift = trainer.cfg.train.sample_guidance, trainer.cfg.train.sampler_shift
    assert (guidance, time_shift) == (2.0, 3.0)
    enc = _Encoders(vae_path=models / "vae", t5_path=models / "t5", clip_path=models / "clip",
                    t5_tokenizer_path=models / "tokenizer", clip_tokenizer_path=models / "tokenizer",
                    t5_len=12, device="cpu", dtype=trainer.compute_dtype)
    t5, clip = enc.captions(prompts)
    z = sample_module.generate_latents(trainer.model, t5, clip, latent_shape=(16, 4, 4), steps=3, seed=5,
                                       shift=0.1159, scale=0.3611, dtype=trainer.compute_dtype,
                                       guidance=guidance, empty=load_empty_encodings(data), time_shift=time_shift)
    with torch.no_grad():
        want = (enc.vae.decode(z.to(enc.dtype)).sample.float() + 1) / 2
    assert len(grids) == 1 and grids[0].shape == (2, 3, 32, 32)
    torch.testing.assert_close(grids[0], want)
    assert float(want.std()) > 0  # a decoded picture, not a constant

    with pytest.raises(SystemExit):  # one encoder alone is a usage error naming the three flags
        main(["sample", str(run), "--prompt", "x", "--vae", str(models / "vae")])
    assert "--vae, --t5 and --clip" in capsys.readouterr().err
