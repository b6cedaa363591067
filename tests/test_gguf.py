"""GGUF loading against transformers' own GGUF loading (PyTorch, CPU, fp32), on small files
written here with `gguf.GGUFWriter` from tiny random transformers models, one per architecture
and tensor type."""
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax.models import gguf as G

from hf_checkpoints import NEEDS_TORCH, torch_logits

gguf = pytest.importorskip("gguf", reason="GGUF loading needs gguf: pip install -e '.[test]'")
torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
import transformers  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# logits against the unquantized model, relative (norm of the difference over the norm): about
# twice what each type's rounding costs this 3-layer model (measured: 4e-7, 5e-4, 5e-3, 1.5e-2,
# 0.20-0.24, 0.20-0.21)
QUANTIZATION_ERROR = {"F32": 2e-6, "F16": 2e-3, "BF16": 1.5e-2, "Q8_0": 3e-2, "Q4_0": 0.4,
                      "Q4_1": 0.4}

# a byte-level BPE vocabulary: 256 bytes, a few merges, two special tokens
SPECIALS = ("<|endoftext|>", "<|im_end|>")
MERGES = ("h e", "l l", "o Ġ", "he ll")
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_theta=10000.0)


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def vocabulary() -> list[str]:
    return byte_tokens() + [m.replace(" ", "") for m in MERGES] + list(SPECIALS)


def source_model(arch: str):
    """A tiny random transformers model of `arch` (fp32, eval), its logits spread out."""
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    cfg = cls(vocab_size=len(vocabulary()), tie_word_embeddings=arch == "qwen2", **TINY)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (HF rows -> its rotary layout)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """llama.cpp's names and layout of a transformers model's tensors (float32)."""
    c = model.config
    out = {}
    for name, t in model.state_dict().items():
        w = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                out["output.weight"] = w
        else:
            _, _, i, *module, kind = name.split(".")
            gname = f"blk.{i}.{GGUF_NAMES['.'.join(module)]}.{kind}"
            if arch == "llama" and module[-1] in ("q_proj", "k_proj"):
                w = llama_cpp_permute(w, c.num_attention_heads if module[-1] == "q_proj"
                                      else c.num_key_value_heads)
            out[gname] = w
    return out


def write_gguf(path, arch: str, tensors: dict[str, np.ndarray], qtype: str, config,
               architecture: str | None = None):
    """A GGUF file of `tensors`: matrices as `qtype`, vectors (norms, biases) F32, as
    llama.cpp stores them; the config's metadata and the byte-level vocabulary."""
    w = gguf.GGUFWriter(str(path), architecture or arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(TINY["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim and head_dim != config.hidden_size // config.num_attention_heads:
        w.add_key_length(head_dim)      # Qwen3: head_dim 128 here, not hidden / heads
        w.add_value_length(head_dim)
    tokens = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(tokens.index(SPECIALS[0]))
    w.add_eos_token_id(tokens.index(SPECIALS[1]))
    w.add_add_bos_token(False)
    for name, t in tensors.items():
        if t.ndim == 1 or qtype == "F32":
            w.add_tensor(name, t.astype(np.float32))
        else:
            data = gguf.quants.quantize(t, Q[qtype])
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def sources():
    return {arch: source_model(arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    """(arch, type) -> a GGUF file of the source model (qwen3: Q8_0 only)."""
    out = {}
    for arch, model in sources.items():
        tensors = gguf_tensors(model, arch)
        for qtype in TYPES if arch != "qwen3" else ("Q8_0",):
            folder = tmp_path_factory.mktemp(f"{arch}-{qtype}")
            out[arch, qtype] = write_gguf(folder / f"tiny-{qtype}.gguf", arch, tensors, qtype,
                                          model.config)
    return out


IDS = np.random.default_rng(0).integers(0, 256, (2, 19))


@pytest.mark.parametrize("arch, qtype", [(a, q) for a in ("llama", "qwen2") for q in TYPES]
                         + [("qwen3", "Q8_0")])
def test_logits_match_transformers_gguf(files, sources, arch, qtype):
    path = files[arch, qtype]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model = sparsejax.from_pretrained(path, dtype=jnp.float32)
    assert model.config.model_type == arch
    got = np.asarray(sparsejax.logits(model, IDS))
    want = torch_logits(reference, IDS)
    assert got.shape == want.shape
    # the same dequantized weights on both sides: only float32 rounding differs
    assert np.max(np.abs(got - want)) <= 1e-4
    # and the quantization's own error against the unquantized model
    exact = torch_logits(sources[arch], IDS)
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel <= QUANTIZATION_ERROR[qtype], rel


@pytest.mark.parametrize("qtype", ["Q4_1", "BF16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_equal_gguf_dequantize(files, arch, qtype):
    path = files[arch, qtype]
    model = sparsejax.from_pretrained(path, dtype=jnp.float32)
    ours = sparsejax.models.hf_state_dict(model)
    c = model.config
    reader = gguf.GGUFReader(str(path))
    assert {G.hf_name(t.name) for t in reader.tensors} == set(ours)
    for t in reader.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            [int(n) for n in reversed(t.shape)])
        got = ours[G.hf_name(t.name)]
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            got = llama_cpp_permute(got, c.num_heads if ".attn_q." in t.name else c.num_kv_heads)
        np.testing.assert_array_equal(got, want, err_msg=t.name)


def test_directory_with_one_gguf(files, tmp_path):
    path = files["qwen2", "Q8_0"]
    model = sparsejax.from_pretrained(path.parent, dtype=jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(sparsejax.logits(model, IDS)),
        np.asarray(sparsejax.logits(sparsejax.from_pretrained(path, dtype=jnp.float32), IDS)))
    shutil.copy(path, tmp_path / "a.gguf")
    shutil.copy(path, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="2 GGUF files.*a.gguf, b.gguf"):
        sparsejax.from_pretrained(tmp_path)


def test_bf16_load(files):
    """dtype="auto" (the default) keeps the dequantized float32, as transformers' GGUF loading
    does; an explicit dtype casts."""
    assert sparsejax.from_pretrained(files["llama", "F16"]).dtype == jnp.float32
    model = sparsejax.from_pretrained(files["llama", "F16"], dtype=jnp.bfloat16)
    assert model.dtype == jnp.bfloat16


def test_tokenizer_from_gguf(files):
    tok = sparsejax.load_tokenizer(files["llama", "Q8_0"])
    assert len(tok) == len(vocabulary())
    text = "hello world, hello GGUF"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    vocab = vocabulary()
    assert ids[0] == vocab.index("hell")   # the merges apply: h e -> he, l l -> ll, he ll
    assert tok.eos_token == SPECIALS[1]


def test_truncated_file(files, tmp_path):
    data = files["llama", "Q4_0"].read_bytes()
    for keep in (len(data) - 100, 600, 20):
        bad = tmp_path / f"cut{keep}.gguf"
        bad.write_bytes(data[:keep])
        with pytest.raises(ValueError, match="truncated"):
            sparsejax.from_pretrained(bad)


def test_unknown_architecture(sources, tmp_path):
    model = sources["llama"]
    path = write_gguf(tmp_path / "gpt2.gguf", "llama", gguf_tensors(model, "llama"), "F32",
                      model.config, architecture="gpt2")
    with pytest.raises(ValueError, match=r"general.architecture='gpt2'.*'llama', 'qwen2'"):
        sparsejax.from_pretrained(path)


def test_unsupported_tensor_type(sources, tmp_path):
    model = sources["qwen2"]
    tensors = gguf_tensors(model, "qwen2")
    path = tmp_path / "i8.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    c = model.config
    for add, value in ((w.add_block_count, c.num_hidden_layers),
                       (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size),
                       (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads),
                       (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_vocab_size, c.vocab_size)):
        add(value)
    for name, t in tensors.items():
        w.add_tensor(name, (t * 100).astype(np.int8) if name == "blk.1.attn_v.weight" else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'blk.1.attn_v.weight' has type I8: expected one of"):
        sparsejax.from_pretrained(path)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="no such GGUF file"):
        sparsejax.from_pretrained("nowhere/model.gguf")
    with pytest.raises(ValueError, match="absent.gguf cannot be read: No such file"):
        sparsejax.load_tokenizer(tmp_path / "absent.gguf")


def test_bad_dtype_named_before_reading(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="dtype=int32: expected a float dtype"):
        sparsejax.from_pretrained(path, dtype=jnp.int32)
