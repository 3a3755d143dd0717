from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rollhub.models import ModelError, TinyModelSpec, build_tiny_model, load_causal_lm, load_tokenizer, logits_of


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_tokenizer_spells_numbers_digit_by_digit_after_bos(tiny_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_dir))
    ids = tok("12+34=").input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(ids[1:]) == ["1", "2", "+", "3", "4", "="]
    answer = [*tok("46", add_special_tokens=False).input_ids, tok.eos_token_id]
    assert tok.decode(answer, skip_special_tokens=True) == "46"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_model_loads_through_from_pretrained_with_an_untied_head(tiny_dir: Path) -> None:
    model = load_causal_lm(str(tiny_dir))
    assert not model.config.tie_word_embeddings
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr()
    logits = logits_of(model(torch.tensor([[1, 19, 20]])))
    assert logits.shape == (1, 3, model.config.vocab_size)


def test_the_build_is_reused_and_a_foreign_directory_refused(tiny_dir: Path, tmp_path: Path) -> None:
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tiny_dir) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ModelError, match="not empty"):
        build_tiny_model(tmp_path)
    with pytest.raises(ModelError, match="num_attention_heads"):
        build_tiny_model(tmp_path / "x", TinyModelSpec(hidden_size=130))
    with pytest.raises(ModelError, match="head size hidden_size / num_attention_heads = 16"):
        build_tiny_model(tmp_path / "x", TinyModelSpec(hidden_size=64))


def test_bad_sources_and_dtypes_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        load_causal_lm(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="dtype"):
        load_causal_lm(str(tmp_path), dtype="int3")
    with pytest.raises(ModelError, match="cannot open"):
        load_causal_lm(str(tmp_path))
