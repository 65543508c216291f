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
