"""stdout holds the document and nothing else when a machine format is asked for (report/__init__.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mbtune.cli.main import asks_for_document
from mbtune.report import document_stream, print_json, stdout_for_documents


@pytest.mark.parametrize(("args", "asks"), [
    (["probe", "-f", "json"], True), (["sweep", "--format", "csv"], True), (["show", "x", "--format=json"], True),
    (["plan", "x", "-fcsv"], True), (["probe"], False), (["probe", "-f", "table"], False),
    (["confirm", "--", "python", "train.py", "--format", "json"], False),  # the user's command's own flag
    (["probe", "-w", "json"], False),
])
def test_a_machine_format_is_told_from_the_command_line(args, asks):
    assert asks_for_document(args) is asks


def test_inside_only_the_document_reaches_stdout_whatever_this_process_or_a_child_prints(capfd):
    with stdout_for_documents():
        print("from this process")
        subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
        print_json({"rows": [1, 2]})
    print("after, stdout again")
    out, err = capfd.readouterr()
    assert out == '{\n  "rows": [\n    1,\n    2\n  ]\n}\nafter, stdout again\n'
    assert "from this process" in err and "from a child" in err
    assert document_stream() is sys.stdout
