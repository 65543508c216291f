"""`dlmc chat`: a conversation whose every answer equals `LLM.generate` over the turns so far;
/reset, /help, unknown commands, the end of input, and a turn the engine refuses."""

import re

from click.testing import CliRunner

from dlmc.cli import main

ARGS = ["--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "12"]


def _chat(model_dir, lines: list[str], *extra: str):
    result = CliRunner().invoke(main, ["chat", "-m", str(model_dir), *ARGS, *extra],
                                input="".join(f"{line}\n" for line in lines))
    assert result.exit_code == 0, result.output
    return result


def test_answers_follow_the_conversation(tiny_dir, tiny_llm):
    result = _chat(tiny_dir, ["Hello", "", "Again", "/reset", "Hello", "/exit", "never read"],
                   "--system", "Be brief.")
    system = {"role": "system", "content": "Be brief."}
    first = [system, {"role": "user", "content": "Hello"}]
    a1 = tiny_llm.generate(messages=first, max_new_tokens=12)
    second = [*first, {"role": "assistant", "content": a1.text},
              {"role": "user", "content": "Again"}]
    a2 = tiny_llm.generate(messages=second, max_new_tokens=12)
    assert a1.text != a2.text
    answers = [re.sub(r"^(you> )+", "", line) for line in result.stdout.splitlines()]
    assert [a for a in answers if a] == [a1.text, a2.text, a1.text]  # /reset keeps the system
    assert "conversation cleared" in result.stderr
    assert result.stderr.count("12 tokens") == 3 and "never read" not in result.output


def test_commands_and_refusals_leave_the_conversation_going(tiny_dir, tiny_llm):
    long_message = "word " * 400  # more than --max-context 128 holds
    result = _chat(tiny_dir, ["/help", "/nope", long_message, "Hello"], "--max-context", "128")
    assert "/reset: forget the conversation" in result.stderr
    assert "unknown command /nope" in result.stderr
    assert "context" in result.stderr and "/reset starts over" in result.stderr
    want = tiny_llm.generate(messages=[{"role": "user", "content": "Hello"}], max_new_tokens=12)
    assert want.text in result.stdout  # the refused turn was left out of the conversation


def test_diffusiongemma_chat(tiny_gemma_dir, tiny_gemma_llm):
    result = _chat(tiny_gemma_dir, ["Hello"], "--seed", "3", "--max-denoising-steps", "4")
    want = tiny_gemma_llm.generate(messages=[{"role": "user", "content": "Hello"}],
                                   max_new_tokens=12, seed=3, max_denoising_steps=4)
    assert want.text and want.text in result.stdout
