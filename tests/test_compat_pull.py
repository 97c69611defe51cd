"""The lookup's command that pulls a row's compiled graphs from its shared compile cache (`compile_cache_url`) for its
compiler: the key its versions give (common/harness/compile_cache.py), every word quoted, in the terminal (numbered
under the table) and as the page builds it (its browser test: tests/test_compat_page.py)."""
from __future__ import annotations

import shlex

import pyarrow as pa
import pyarrow.parquet as pq

from common.harness import compile_cache
from compat_check import lookup, page, rows

NEURON = {"neuronx-cc": "2.23.6484.0", "torch-neuronx": "2.14.3", "torch": "2.14.0", "python": "3.11.7"}
NEURON_KEY = "neuron_neuronx-cc-2.23.6484.0_torch-neuronx-2.14.3"
HOSTILE_URL = "s3://team bucket/cc'; touch PWNED $(id) `id` | sh"


def _words(line: str) -> list[str]:
    """The words of one shell line, an unquoted control operator (; & | && ( ) < >) as a word of its own."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def test_the_pull_command_quotes_every_word_and_names_the_rows_key():
    command, key = page.pull_command(HOSTILE_URL, "neuron", NEURON)
    assert key == NEURON_KEY == compile_cache.key_from_versions("neuron", NEURON)
    argv = ["python", "-m", "tools.compile_cache", "pull", HOSTILE_URL, "--device", "neuron", "--key", NEURON_KEY]
    assert shlex.split(command) == argv and _words(command) == argv  # one command, the URL one word
    assert page.pull_command("s3://b/cc", None, NEURON)[0].endswith("--device neuron --key " + NEURON_KEY)  # public
    cuda, no_key = page.pull_command("/fsx/cc", "cuda", {"torch": "2.14.1", "python": "3.12.1"})
    assert (cuda, no_key) == ("python -m tools.compile_cache pull /fsx/cc --device cuda", None)  # no CUDA version
    for url in (None, "", "  ", "/fsx/cc\ntouch PWNED", "/fsx/\x1b[2Jcc", 3.5):
        assert page.pull_command(url, "neuron", NEURON) == (None, None)


def test_a_cpu_rows_key_is_the_key_of_the_host_that_wrote_it():
    stack = rows.stack_versions()  # what the check records of this host
    versions = {part: stack[column] for part, column in page.KEY_COLUMNS.items()}
    assert page.pull_command("/fsx/cc", "cpu", versions)[1] == compile_cache.cache_key("cpu")


def test_the_terminal_numbers_each_pull_command_and_says_when_none_is_recorded(tmp_path, capsys):
    stack = {"neuronx_cc": "2.23.6484.0", "library": "transformers", "library_version": "5.16.0",
             "transformers": "5.16.0", "torch_neuronx": "2.14.3", "torch": "2.14.0", "python": "3.11.7"}
    path = rows.results_file(tmp_path, stack)
    for model_id, url in (("org/a", HOSTILE_URL), ("org/b", HOSTILE_URL), ("org/c", "/fsx/cc"), ("org/d", None),
                          ("org/e", "/fsx/cc\ntouch PWNED")):
        rows.write_row(path, dict(stack, model_id=model_id, result="PASS", device="neuron", task="text-generation",
                                  compile_cache_url=url))
    assert pq.read_schema(path).field("compile_cache_url").type == "string"  # one of our text columns
    assert lookup.lookup_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    header, table = out[0].split(), [line.split() for line in out[1:6]]
    marks = [cells[header.index("pull")] for cells in table]
    assert marks == ["[1]", "[1]", "[2]", "-", "-"]
    first, second = out[6], out[7]
    assert first.startswith("[1] python -m tools.compile_cache pull ") and first.endswith("  (2 row(s))")
    assert shlex.split(first[4:-len("  (2 row(s))")]) == [
        "python", "-m", "tools.compile_cache", "pull", HOSTILE_URL, "--device", "neuron", "--key", NEURON_KEY]
    assert second == f"[2] python -m tools.compile_cache pull /fsx/cc --device neuron --key {NEURON_KEY}  (1 row(s))"
    assert out[8:] == ["1 row(s) record a shared compile cache that is not one printable line: no command",
                       "no shared compile cache recorded: 1 of 5 row(s)",
                       "5 row(s): 5 PASS, 0 FAIL, 0 EXCLUDED (not failures)"]
    public = tmp_path / "public" / "rows.parquet"  # the public schema: no such column
    public.parent.mkdir()
    pq.write_table(pa.table({"model_id": ["org/f"], "result": ["PASS"], "neuronx_cc": ["2.23.6484.0"]}), public)
    assert lookup.lookup_main([str(public)]) == 0
    assert capsys.readouterr().out.splitlines()[-2] == "no shared compile cache recorded: 1 of 1 row(s)"
