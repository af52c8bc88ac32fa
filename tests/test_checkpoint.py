"""Official checkpoint I/O: codecs, writer / loader round trips, errors, memory."""

import gc
import json
import os
import shutil
import tracemalloc

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dspark_jax
from dspark_jax import config
from dspark_jax.checkpoint import codecs, hf
from dspark_jax.checkpoint.files import CheckpointFileError
from dspark_jax.checkpoint.hf import CheckpointError
from dspark_jax.config import ConfigError
from tests.checkpoint_helpers import (flat_params, random_model, read_safetensors, ref_decode, ref_decode_fp4,
                                      ref_decode_fp8, ref_e8m0)


def _matrix(rng, shape, spread=6):
    """Random values whose magnitude varies by 2**U(-spread, spread) per row and per 32 columns."""
    gain = np.exp2(rng.uniform(-spread, spread, (shape[0], -(-shape[1] // 32))))
    return (rng.standard_normal(shape) * np.repeat(gain, 32, axis=1)[:, :shape[1]]).astype(np.float32)


# ---------------------------------------------------------------------------- codecs
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (128, 64)])
def test_fp8_codec_matches_reference_decoder(shape):
    rng = np.random.default_rng(0)
    w = _matrix(rng, shape)
    w[:128, :128] = 0.0  # an all-zero block must still get a valid scale
    q, s = codecs.encode_fp8(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == shape
    assert s.dtype == ml_dtypes.float8_e8m0fnu and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    ref = ref_decode_fp8(q.view(np.uint8), s.view(np.uint8))
    dec = codecs.decode_fp8(q, s, np.float32)
    np.testing.assert_array_equal(dec, ref.astype(np.float32))
    # each block: scale = 2**ceil(log2(amax / 448)); error below half an e4m3 step
    full_s = np.kron(ref_e8m0(s.view(np.uint8)), np.ones((128, 128)))[:shape[0], :shape[1]]
    assert np.all(np.abs(w - ref) <= np.maximum(np.abs(w) * 2.0**-4, full_s * 2.0**-10))
    assert np.all(dec[:128, :128] == 0)
    # decoded values re-encode to themselves
    q2, s2 = codecs.encode_fp8(dec)
    np.testing.assert_array_equal(codecs.decode_fp8(q2, s2), dec)


@pytest.mark.parametrize("shape", [(64, 256), (3, 32)])
def test_fp4_codec_matches_reference_decoder(shape):
    rng = np.random.default_rng(1)
    w = _matrix(rng, shape)
    packed, s = codecs.encode_fp4(w)
    assert packed.dtype == np.int8 and packed.shape == (shape[0], shape[1] // 2)
    assert s.dtype == ml_dtypes.float8_e8m0fnu and s.shape == (shape[0], shape[1] // 32)
    ref = ref_decode_fp4(packed, s.view(np.uint8))
    dec = codecs.decode_fp4(packed, s, np.float32)
    np.testing.assert_array_equal(dec, ref.astype(np.float32))
    full_s = np.repeat(ref_e8m0(s.view(np.uint8)), 32, axis=1)
    assert np.all(np.abs(w - ref) <= 0.25 * np.maximum(np.abs(w), full_s))
    assert np.all(np.abs(ref) <= 6 * full_s)
    packed2, s2 = codecs.encode_fp4(dec)
    np.testing.assert_array_equal(codecs.decode_fp4(packed2, s2), dec)


def test_fp4_nibble_order_and_e8m0_values():
    """Element 2k sits in the low nibble: [0.5, -6] at scale 1 is one byte 0xF1."""
    w = np.zeros((1, 32), np.float32)
    w[0, :2] = [0.5, -6.0]
    packed, s = codecs.encode_fp4(w)
    assert packed.view(np.uint8)[0, 0] == 0xF1 and s.view(np.uint8)[0, 0] == 127
    b = np.array([0, 1, 126, 127, 128, 200, 254, 255], np.uint8)
    np.testing.assert_array_equal(codecs.e8m0_to_float(b), ref_e8m0(b).astype(np.float32))
    with pytest.raises(codecs.CodecError, match="multiple of 32"):
        codecs.encode_fp4(np.ones((2, 48), np.float32))
    with pytest.raises(codecs.CodecError, match="NaN"):
        codecs.encode_fp8(np.full((2, 2), np.nan, np.float32))


# ---------------------------------------------------------------------------- round trips
@pytest.fixture(scope="module")
def tiny_model():
    return random_model(config.tiny(), seed=0, param_dtype=jnp.float32)


@pytest.fixture(scope="module")
def tiny_bf16_dir(tiny_model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny_bf16")
    hf.save_official(tiny_model, path, encoding="bf16")
    return path


def test_round_trip_bf16(tiny_model, tiny_bf16_dir, tmp_path):
    m = dspark_jax.load(tiny_bf16_dir, dtype=jnp.float32, progress=False)
    assert m.config == tiny_model.config and m.config.dspark.num_stages == 3
    assert m.numerics.quant_sim is False  # nothing quantised in the files
    stored = read_safetensors(tiny_bf16_dir)
    assert {d for d, _, _ in stored.values()} == {"BF16", "F32", "I64"}
    orig, got = flat_params(tiny_model), flat_params(m)
    assert orig.keys() == got.keys()
    for name, (path, expert, _) in hf.official_names(m.module).items():
        dtype, raw, shape = stored[name]
        want = orig[path] if expert is None else orig[path][expert]
        have = got[path] if expert is None else got[path][expert]
        if dtype == "BF16":
            want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(have, want, err_msg=name)  # bit-exact (bf16-rounded where stored bf16)
        np.testing.assert_array_equal(have, ref_decode(dtype, raw, shape), err_msg=name)
    # writing the loaded model again reproduces the files byte for byte
    hf.save_official(m, str(tmp_path / "again"), encoding="bf16")
    again = read_safetensors(str(tmp_path / "again"))
    assert again.keys() == stored.keys()
    for name, (dtype, raw, shape) in stored.items():
        assert again[name][0] == dtype and again[name][2] == shape and np.array_equal(again[name][1], raw), name


def test_round_trip_official_encoding(tiny_model, tmp_path):
    path = str(tmp_path / "official")
    hf.save_official(tiny_model, path, encoding="official", max_shard_bytes=1 << 20)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 2  # sharded
    stored = read_safetensors(path)
    fmt = {n: d for n, (d, _, _) in stored.items()}
    assert fmt["layers.0.attn.wq_a.weight"] == "F8_E4M3" and fmt["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert fmt["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3" and fmt["mtp.0.main_proj.weight"] == "F8_E4M3"
    assert fmt["layers.3.ffn.experts.5.w2.weight"] == "I8" and fmt["layers.3.ffn.experts.5.w2.scale"] == "F8_E8M0"
    assert fmt["embed.weight"] == fmt["layers.0.attn_norm.weight"] == fmt["mtp.2.markov_head.markov_w1.weight"] == "BF16"
    assert fmt["layers.0.hc_attn_fn"] == fmt["layers.0.attn.attn_sink"] == fmt["layers.3.ffn.gate.bias"] == "F32"
    assert fmt["layers.0.ffn.gate.tid2eid"] == "I64"
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [128, 128]

    # by default FP8 / FP4 tensors stay as stored: the very bytes of the files
    q = dspark_jax.load(path, dtype=jnp.float32, progress=False)
    assert q.numerics.weight_format == "official" and q.numerics.quant_sim is True
    kept = flat_params(q)
    for name, path_, expert in (("layers.0.attn.wq_a", "layers.0.attn.wq_a.weight", None),
                                ("mtp.0.main_proj", "mtp.0.main_proj.weight", None),
                                ("layers.3.ffn.experts.5.w2", "layers.3.ffn.experts.w2", 5)):
        scale_ = hf.scale_path(path_)
        have_w, have_s = kept[path_], kept[scale_]
        if expert is not None:
            have_w, have_s = have_w[expert], have_s[expert]
        assert have_w.tobytes() == stored[name + ".weight"][1].tobytes(), name
        assert have_s.tobytes() == stored[name + ".scale"][1].tobytes(), name
    assert kept["embed.weight"].dtype == np.float32  # bf16 tensors are unaffected
    # "fp8": the FP4 experts widened to e4m3 codes with scales per 128 inputs, the same values
    wide = flat_params(dspark_jax.load(path, dtype=jnp.float32, weight_format="fp8", progress=False))
    packed = stored["layers.3.ffn.experts.5.w2.weight"][1].reshape(kept["layers.3.ffn.experts.w2"].shape[1:])
    scale32 = stored["layers.3.ffn.experts.5.w2.scale"][1].reshape(packed.shape[0], -1)
    codes, scale128 = codecs.fp4_to_e4m3_k128(packed, scale32)
    assert wide["layers.3.ffn.experts.w2"][5].tobytes() == codes.tobytes()
    assert wide["layers.3.ffn.experts.w2_scale"][5].tobytes() == scale128.tobytes()
    np.testing.assert_array_equal(codecs.decode_fp8_k128(codes, scale128), codecs.decode_fp4(packed, scale32))
    assert wide["layers.0.attn.wq_a.weight"].tobytes() == kept["layers.0.attn.wq_a.weight"].tobytes()

    m = dspark_jax.load(path, dtype=jnp.float32, weight_format="dense", progress=False)
    assert m.numerics.quant_sim is True  # default for fp8 / fp4 checkpoints
    got = flat_params(m)
    orig = flat_params(tiny_model)
    for name, (ppath, expert, _) in hf.official_names(m.module).items():
        dtype, raw, shape = stored[name]
        have = got[ppath] if expert is None else got[ppath][expert]
        scale = stored.get(hf.scale_name(name)) if dtype in ("F8_E4M3", "I8") else None
        np.testing.assert_array_equal(have, ref_decode(dtype, raw, shape, scale), err_msg=name)
        want = orig[ppath] if expert is None else orig[ppath][expert]
        tol = {"F8_E4M3": 2.0**-3, "I8": 0.5}.get(dtype, 2.0**-8)
        assert np.max(np.abs(have - want)) <= tol * np.max(np.abs(want)) + 1e-30, name
    # decoded values are fixed points of the encoding
    hf.save_official(m, str(tmp_path / "again"), encoding="official")
    m2 = dspark_jax.load(str(tmp_path / "again"), dtype=jnp.float32, weight_format="dense", progress=False)
    for k, v in flat_params(m2).items():
        np.testing.assert_array_equal(v, got[k], err_msg=k)
    # the same files load into bf16 parameters exactly (fp8 / fp4 values times powers of two fit bf16)
    mb = dspark_jax.load(path, dtype=jnp.bfloat16, quant_sim=False, weight_format="dense", progress=False)
    assert mb.numerics.quant_sim is False
    for k, v in flat_params(mb).items():
        np.testing.assert_array_equal(v.astype(np.float32), got[k], err_msg=k)


def test_hf_parity_fixture_loads_target_only():
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "hf_parity")
    m = dspark_jax.load(fixture, dtype=jnp.float32, progress=False)
    assert m.config.dspark is None and m.config.num_hidden_layers == 4 and m.numerics.quant_sim is False
    ref = load_file(os.path.join(fixture, "model.safetensors"))
    got = flat_params(m)
    np.testing.assert_array_equal(got["layers.2.ffn.experts.w2"][3],
                                  ref["layers.2.ffn.experts.3.w2.weight"].astype(np.float32))
    np.testing.assert_array_equal(got["layers.0.ffn.gate.tid2eid"], ref["layers.0.ffn.gate.tid2eid"])
    with pytest.raises(CheckpointError, match="no DSpark drafter"):
        dspark_jax.load(fixture, dspark=True, progress=False)


# ---------------------------------------------------------------------------- errors
def _edit(src: str, dst, change) -> str:
    """Copy a single-file checkpoint and apply ``change(tensors: dict)`` to its tensors."""
    dst = str(dst)
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def _load(path, **kw):
    return dspark_jax.load(path, dtype=jnp.float32, progress=False, **kw)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("layers.2.attn.wkv.weight"), r"missing tensors \(1\): \['layers.2.attn.wkv.weight'\]"),
    (lambda t: t.pop("layers.4.ffn.experts.7.w3.weight"), r"missing tensors \(1\): \['layers.4.ffn.experts.7.w3"),
    (lambda t: t.pop("mtp.0.main_proj.weight"), r"missing tensors \(1\): \['mtp.0.main_proj.weight'\]"),
    (lambda t: t.update({"layers.1.attn.bogus.weight": np.ones(3, np.float32)}),
     r"unexpected tensors \(1\): \['layers.1.attn.bogus.weight'\]"),
    (lambda t: t.update({"layers.1.attn.wkv.weight": np.ones((128, 64), ml_dtypes.bfloat16)}),
     r"tensor layers.1.attn.wkv.weight: expected shape \[128, 128\], found \[128, 64\]"),
    (lambda t: t.update({"layers.0.ffn.experts.2.w2.weight": np.ones((128, 129), ml_dtypes.bfloat16)}),
     r"tensor layers.0.ffn.experts.2.w2.weight: expected shape \[128, 128\], found \[128, 129\]"),
    (lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"].astype(np.float32)}),
     r"tensor layers.0.ffn.gate.tid2eid: expected dtype integer .* found F32"),
    (lambda t: t.update({"layers.0.attn.wq_a.weight": np.ones((128, 128), ml_dtypes.float8_e4m3fn)}),
     r"tensor layers.0.attn.wq_a.weight: expected dtype .* found F8_E4M3 \[128, 128\]"),  # fp8 without .scale
    (lambda t: t.update({"layers.0.attn.wq_b.scale": np.ones((4, 1), np.float32)}),
     r"tensor layers.0.attn.wq_b.weight: expected dtype .* found BF16 \[512, 128\] with .scale"),
    (lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"] + 8}),
     r"tensor layers.0.ffn.gate.tid2eid: values must lie in \[0, 8\)"),
    (lambda t: t.update({"mtp.3.attn_norm.weight": np.ones(128, ml_dtypes.bfloat16)}),
     r"missing tensors .*mtp.3."),  # a 4th stage: every other tensor of it is missing
])
def test_mismatched_checkpoints(tiny_bf16_dir, tmp_path, change, message):
    with pytest.raises(CheckpointError, match=message):
        _load(_edit(tiny_bf16_dir, tmp_path / "bad", change))


def test_all_problems_reported_together(tiny_bf16_dir, tmp_path):
    def change(t):
        t.pop("norm.weight")
        t["extra"] = np.ones(2, np.float32)
        t["head.weight"] = t["head.weight"][:, :10].copy()
    with pytest.raises(CheckpointError) as e:
        _load(_edit(tiny_bf16_dir, tmp_path / "bad", change))
    text = str(e.value)
    assert "['norm.weight']" in text and "['extra']" in text and "tensor head.weight: expected shape" in text


def test_mtp_stages(tiny_bf16_dir, tmp_path):
    # target-only loading of a DSpark checkpoint, and a legacy MTP module that is skipped knowingly
    m = _load(tiny_bf16_dir, dspark=False)
    assert m.config.dspark is None and not hasattr(m.module, "mtp")

    def drop_mtp(t):
        for k in [k for k in t if k.startswith("mtp.")]:
            del t[k]
    target_only = _edit(tiny_bf16_dir, tmp_path / "target_only", drop_mtp)  # config.json keeps its dspark_* keys
    assert _load(target_only).config.dspark is None
    with pytest.raises(CheckpointError, match=r"no DSpark drafter \(no mtp.\* tensors\); speculative decoding needs"):
        _load(target_only, dspark=True)

    def legacy(t):
        for k in [k for k in t if k.startswith("mtp.")]:
            del t[k]
        t["mtp.0.e_proj.weight"] = np.ones((128, 128), ml_dtypes.bfloat16)
        t["mtp.0.attn_norm.weight"] = np.ones(128, ml_dtypes.bfloat16)
    path = _edit(tiny_bf16_dir, tmp_path / "legacy", legacy)
    m = _load(path)
    assert m.config.dspark is None
    with pytest.raises(CheckpointError, match=r"no DSpark drafter \(only a legacy MTP module"):
        _load(path, dspark=True)

    cfg = json.load(open(os.path.join(tiny_bf16_dir, "config.json")))
    for k in [k for k in cfg if k.startswith("dspark_")]:
        del cfg[k]
    nokeys = _edit(tiny_bf16_dir, tmp_path / "nokeys", lambda t: None)
    json.dump(cfg, open(os.path.join(nokeys, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="no dspark_\\* keys"):
        _load(nokeys)

    def gap(t):
        for k in [k for k in t if k.startswith("mtp.1.")]:
            t[k.replace("mtp.1.", "mtp.5.")] = t.pop(k)
    with pytest.raises(CheckpointError, match=r"numbered mtp.0 .. mtp.2; found mtp.\[0, 2, 5\]"):
        _load(_edit(tiny_bf16_dir, tmp_path / "gap", gap))


def test_unsupported_architecture_and_bad_files(tiny_bf16_dir, tmp_path):
    path = _edit(tiny_bf16_dir, tmp_path / "llama", lambda t: None)
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
              open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ConfigError, match="unsupported architecture"):
        _load(path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        _load(str(tmp_path))
    shutil.copytree(tiny_bf16_dir, tmp_path / "index")
    with open(tmp_path / "index" / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"embed.weight": "model.safetensors"}}, f)
    with pytest.raises(ValueError, match="disagrees with the shard headers"):
        _load(str(tmp_path / "index"))


def _drop_key(key):
    def edit(path):
        cfg = json.load(open(path))
        del cfg[key]
        json.dump(cfg, open(path, "w"))
    return edit


def _set_key(key, value):
    def edit(path):
        cfg = json.load(open(path))
        cfg[key] = value
        json.dump(cfg, open(path, "w"))
    return edit


def _write(text):
    def edit(path):
        with open(path, "w") as f:
            f.write(text)
    return edit


@pytest.mark.parametrize("file, edit, error, message", [
    ("config.json", _drop_key("hidden_size"), ConfigError, r"config.json: missing required keys \['hidden_size'\]"),
    ("config.json", _set_key("hidden_size", "128"), ConfigError,
     r"config.json: these keys must hold integers: hidden_size='128'"),
    ("config.json", _drop_key("dspark_markov_rank"), ConfigError, r"config.json: missing key 'dspark_markov_rank'"),
    ("config.json", _set_key("n_shared_experts", 2), ConfigError, r"config.json: DeepSeek-V4 has exactly one shared"),
    ("config.json", _write("{not json"), ConfigError, r"config.json: not valid JSON"),
    ("config.json", _write("[1, 2]"), ConfigError, r"config.json: expected a JSON object, got list"),
    ("tokenizer.json", _write("{}"), CheckpointFileError, r"tokenizer.json: not a tokenizer file .*Model missing"),
    ("tokenizer.json", _write("{not json"), CheckpointFileError, r"tokenizer.json: not valid JSON"),
    ("sts.json", _write("{not json"), CheckpointError, r"sts.json: not valid JSON"),
    ("sts.json", _write("[1.0, 2.0, 3.0]"), CheckpointError, r"sts.json: expected 3 positive temperatures"),
    ("sts.json", _write('{"temperatures": ["a", 1, 1]}'), CheckpointError, r"sts.json: expected 3 positive"),
    ("model.safetensors.index.json", _write("{oops"), CheckpointFileError,
     r"model.safetensors.index.json: not valid JSON"),
    ("model.safetensors.index.json", _write('{"weight_map": {"embed.weight": 5}}'), CheckpointFileError,
     r"model.safetensors.index.json has no weight_map of tensor names to file names"),
])
def test_malformed_files_are_named(small_checkpoint, tmp_path, file, edit, error, message):
    """Each malformed JSON file of a checkpoint gives an error naming the file (and the key)."""
    path = tmp_path / "bad"
    shutil.copytree(small_checkpoint, path)
    if file == "model.safetensors.index.json":  # the small checkpoint is one file: list it in an index
        with open(path / file, "w") as f:
            json.dump({"weight_map": {}}, f)
    edit(str(path / file))
    with pytest.raises(error, match=message):
        _load(str(path))


# ---------------------------------------------------------------------------- memory
def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"{key} not in /proc/self/status")


def test_peak_host_memory_while_loading(tmp_path):
    """Peak host memory of a load stays below the output plus 1.3x the largest tensor.

    The checkpoint is dominated by the embedding and the lm_head (64 MiB each). Two measures:
    numpy allocations seen by tracemalloc (host buffers: the output lives in XLA buffers) and the
    process peak RSS (VmHWM, reset before the load), which includes the loaded parameters
    themselves on the CPU backend.
    """
    cfg = config.tiny(dspark=False).replace(vocab_size=1 << 18)
    path = str(tmp_path / "big")
    hf.save_official(random_model(cfg, seed=3, param_dtype=jnp.bfloat16), path)
    largest = max(v.nbytes for v in flat_params(_load_bf16(path)).values())
    assert largest == (1 << 18) * cfg.hidden_size * 2
    gc.collect()  # (the first load also compiled the expert-stacking functions)

    base = _status_bytes("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    tracemalloc.start()
    try:
        m = _load_bf16(path)
        _, host_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    peak = _status_bytes("VmHWM:") - base
    output = sum(v.nbytes for v in flat_params(m).values())
    mib = 2**20
    print(f"largest {largest / mib:.1f} MiB, output {output / mib:.1f} MiB, host buffers peak {host_peak / mib:.1f} "
          f"MiB, RSS peak growth {peak / mib:.1f} MiB")
    assert host_peak < 1.3 * largest
    assert peak < output + 1.3 * largest


def _load_bf16(path):
    return dspark_jax.load(path, dtype=jnp.bfloat16, progress=False)
