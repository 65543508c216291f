import json

from click.testing import CliRunner

from dlmc.cli import main


def test_generate_plain_text_and_stats(tiny_dir):
    result = CliRunner().invoke(
        main, ["generate", "--model", str(tiny_dir), "Hello", "--max-new-tokens", "20"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert "20 tokens" in lines[-1] and "forwards" in lines[-1] and "TPF" in lines[-1]
    short = CliRunner().invoke(main, ["generate", "-m", str(tiny_dir), "Hello",
                                      "--max-new-tokens", "20"])  # -m as in `bench suite`
    assert short.exit_code == 0 and short.output.splitlines()[:-1] == lines[:-1]
    pinned = CliRunner().invoke(main, ["generate", "-m", str(tiny_dir), "--revision", "v1", "Hi"])
    assert pinned.exit_code == 1 and "--revision v1: only a Hugging Face repo id" in pinned.output


def test_generate_json_matches_the_api(tiny_dir, tiny_llm):
    args = [
        "generate",
        "--model",
        str(tiny_dir),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "Hello",
        "--max-new-tokens",
        "24",
        "--json",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    want = tiny_llm.generate(messages=[{"role": "user", "content": "Hello"}], max_new_tokens=24)
    assert data["token_ids"] == want.token_ids and data["finish_reason"] == "length"
    stops = [want.text[12:14], want.text[5:7]]  # the second appears first
    result = CliRunner().invoke(main, [*args, "--stop", stops[0], "--stop", stops[1]])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["text"] == want.text[: want.text.find(stops[1])]
    assert (data["finish_reason"], data["stop_reason"]) == ("stop", stops[1])


def test_generate_options_and_errors(tiny_dir, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["generate", "--model", str(tmp_path / "nope"), "hi"])
    assert res.exit_code == 1 and "no such directory" in res.output
    assert "Traceback" not in res.output
    res = runner.invoke(main, ["generate", "--model", str(tiny_dir), "--threshold", "2", "hi"])
    assert res.exit_code == 1 and "`threshold`" in res.output
    res = runner.invoke(main, ["generate", "--model", str(tiny_dir), "--edit-threshold", "x", "hi"])
    assert res.exit_code == 2 and "expected a number or 'none'" in res.output
    res = runner.invoke(
        main,
        [
            "generate",
            "--model",
            str(tiny_dir),
            "--json",
            "--raw",
            "--edit-threshold",
            "none",
            "--max-new-tokens",
            "8",
            "hi",
        ],
    )
    assert res.exit_code == 0 and json.loads(res.output)["settings"]["edit_threshold"] is None
    res = runner.invoke(
        main, ["generate", "--model", str(tiny_dir), "--max-new-tokens", "4"], input="from stdin"
    )
    assert res.exit_code == 0, res.output


def test_python_dash_m_help():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "dlmc", "--help"], capture_output=True, text=True, check=True
    )
    assert "generate" in out.stdout


def test_generate_diffusiongemma_json_matches_the_api(tiny_gemma_dir, tiny_gemma_llm):
    args = ["generate", "--model", str(tiny_gemma_dir), "--dtype", "fp32", "--device", "cpu",
            "Hello", "--max-denoising-steps", "4", "--t-max", "0.7", "--seed", "5", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    want = tiny_gemma_llm.generate(messages=[{"role": "user", "content": "Hello"}],
                                   max_denoising_steps=4, t_max=0.7, seed=5)
    assert data["token_ids"] == want.token_ids and data["settings"]["t_max"] == 0.7
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_gemma_dir), "--threshold",
                                    "0.5", "hi"])
    assert res.exit_code == 1 and "`threshold`: a LLaDA2 setting" in res.output
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_gemma_dir), "--raw",
                                    "--max-denoising-steps", "2", "--max-new-tokens", "8", "hi"])
    assert res.exit_code == 0 and "forwards" in res.output.strip().splitlines()[-1]
