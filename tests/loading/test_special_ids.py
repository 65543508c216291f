import json

from dlmc.loading.special_ids import LLADA2_EOS_ID, LLADA2_MASK_ID, resolve_special_ids


def test_precedence(tmp_path):
    tok = {"mask_token_id": 11, "eos_token_id": 12}
    ids = resolve_special_ids(tmp_path, lambda: tok)
    assert (ids.mask_token_id, ids.eos_token_id) == (11, 12)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [21, 22]}))
    ids = resolve_special_ids(tmp_path, lambda: tok)
    assert (ids.mask_token_id, ids.eos_token_id) == (11, 21)
    (tmp_path / "paper_decoding.json").write_text(json.dumps({"decoding": {"mask_token_id": 31}}))
    ids = resolve_special_ids(tmp_path, lambda: tok)
    assert (ids.mask_token_id, ids.eos_token_id) == (31, 21)
    assert "paper_decoding.json" in ids.source and "generation_config.json" in ids.source


def test_defaults_without_tokenizer(tmp_path):
    def broken():
        raise OSError("no tokenizer")

    ids = resolve_special_ids(tmp_path, broken)
    assert (
        (ids.mask_token_id, ids.eos_token_id) == (LLADA2_MASK_ID, LLADA2_EOS_ID) == (156895, 156892)
    )


def test_the_same_ids_in_every_source_take_the_documented_order(tmp_path):
    """docs/llada2.md §4: paper_decoding.json (a nested section before its top level), then
    generation_config.json (a list's first id), then the tokenizer, then the LLaDA2 defaults;
    config.json is not one of them. The tokenizer is asked only for an id the files lack."""
    calls = []

    def tokenizer():
        calls.append(1)
        return {"mask_token_id": 11, "eos_token_id": 12}

    def write(name, data):
        (tmp_path / name).write_text(json.dumps(data))

    def ids():
        found = resolve_special_ids(tmp_path, tokenizer)
        return found.mask_token_id, found.eos_token_id

    write("config.json", {"mask_token_id": 51, "eos_token_id": 52, "pad_token_id": 52})
    write("generation_config.json", {"mask_token_id": 21, "eos_token_id": [22, 23]})
    write("paper_decoding.json", {"mask_token_id": 41, "eos_token_id": 42,
                                  "decoding": {"mask_token_id": 31, "eos_token_id": 32}})
    assert ids() == (31, 32) and not calls
    write("paper_decoding.json", {"mask_token_id": 41, "eos_token_id": 42})
    assert ids() == (41, 42)
    write("paper_decoding.json", {"mask_token_id": 41})  # eos from the next source
    assert ids() == (41, 22)
    source = resolve_special_ids(tmp_path, tokenizer).source
    assert source == "mask from paper_decoding.json, eos from generation_config.json"
    (tmp_path / "paper_decoding.json").unlink()
    assert ids() == (21, 22) and not calls
    write("generation_config.json", {"eos_token_id": 22})
    assert ids() == (11, 22) and len(calls) == 1  # the tokenizer only for what is missing
    (tmp_path / "generation_config.json").unlink()
    assert ids() == (11, 12)

    def no_tokenizer():
        raise OSError("no tokenizer")

    found = resolve_special_ids(tmp_path, no_tokenizer)
    assert (found.mask_token_id, found.eos_token_id) == (LLADA2_MASK_ID, LLADA2_EOS_ID)
