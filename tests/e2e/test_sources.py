"""Answers cite their sources (issue 32): a fact on page 3 of a PDF is answered from page 3, and says so.

One real ingest (the default model, in this process) of the service manual PDF, a slide deck, a book and a Markdown
guide; one query in process (its `to_dict()` is what `query --json` prints) and one through the CLI for the human
`Sources:` line; `ls` and `show` load no model.
"""

from __future__ import annotations

import json
import re

from kvblend.generation import SamplingConfig
from kvblend.pipeline import Engine, QueryOptions
from support import FIXTURES, run_cli

DOCUMENTS = FIXTURES / "documents"
QUESTION = "What is the Orca-7 pump's maximum pressure?"  # page 3, "Operating limits": 412 kPa
PAGE_3 = {"pages": [3, 3], "section": "Operating limits", "sections": None, "rows": None}


def test_a_fact_from_page_3_is_answered_from_and_cited_as_page_3(tmp_path, default_runner):
    arc = tmp_path / "arc"
    with Engine(arc, runner=default_runner) as engine:
        # 128 tokens: the 4-page manual (~330 tokens) is one segment per page, each starting at its heading
        docs = ["manual.pdf", "briefing.pptx", "handbook.epub", "budget.xlsx", "quickstart.md"]
        # a spreadsheet exported as CSV (Excel's ";" where the decimal mark is a comma)
        (tmp_path / "parts.csv").write_text("Part;Cost (EUR)\nSeal kit;11,75\nImpeller;1011,25\n")
        # and LibreOffice's format, as odfdo writes it
        from odfdo import Document, Header, Paragraph

        odt = Document("text")
        odt.body.extend([Header(1, "Dock log"), Paragraph("The Tern-4 sonar left Halifax on the 3rd.")])
        odt.save(tmp_path / "log.odt")
        # a Jupyter notebook as Jupyter saves it: JSON, whose escapes and base64 plots must not become the KV
        cells = [{"cell_type": "markdown", "metadata": {}, "source": ["## Sonar trials\n", "\n", "Tern-4 depths."]},
                 {"cell_type": "code", "execution_count": 1, "metadata": {}, "source": ["# depths\n", "plot(d)"],
                  "outputs": [{"output_type": "display_data", "metadata": {},
                               "data": {"image/png": "iVBORw0KGgo" + "A" * 3000, "text/plain": ["<Figure>"]}}]}]
        (tmp_path / "trials.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                                           "nbformat_minor": 5}, indent=1))
        # a meeting's transcript: cited by the minutes a passage was said in
        (tmp_path / "standup.vtt").write_text("WEBVTT\n\n00:00:02.000 --> 00:00:06.000\n<v Ana>The impeller order "
                                              "shipped.\n\n00:00:06.000 --> 00:00:09.500\n<v Ben>Good, thanks.\n")
        extra = [tmp_path / "parts.csv", tmp_path / "log.odt", tmp_path / "trials.ipynb", tmp_path / "standup.vtt"]
        engine.ingest([*(DOCUMENTS / name for name in docs), *extra], chunk_tokens=128)
        result = engine.query(QUESTION, QueryOptions(top_k=1, sampling=SamplingConfig(max_new_tokens=16)))
    (segment,) = result.to_dict()["segments"]
    assert segment["document"] == "manual.pdf"
    assert {k: segment[k] for k in PAGE_3} == PAGE_3
    assert "412" in result.answer

    listed = {d["name"]: d for d in json.loads(run_cli("ls", "--archive", arc, "--json", check=True).stdout)}
    assert (listed["manual.pdf"]["format"], listed["manual.pdf"]["pages"]) == ("pdf", 4)
    assert (listed["quickstart.md"]["format"], listed["quickstart.md"]["pages"]) == ("markdown", 0)
    shown = json.loads(run_cli("show", "manual.pdf", "--archive", arc, "--json", check=True).stdout)
    assert shown["format"] == "pdf" and shown["pages"] == 4
    assert len(shown["sources"]) == len(shown["segments"]) == 4 and shown["sources"][2] == PAGE_3
    assert [s["pages"] for s in shown["sources"]] == [[1, 1], [2, 2], [3, 3], [4, 4]]
    # a deck's slides are its pages; each slide's title names its section
    assert (listed["briefing.pptx"]["format"], listed["briefing.pptx"]["pages"]) == ("pptx", 6)
    deck = json.loads(run_cli("show", "briefing.pptx", "--archive", arc, "--json", check=True).stdout)
    assert {"pages": [3, 3], "section": "Service costs", "sections": None, "rows": None} in deck["sources"], deck["sources"]
    # a book has no pages (EPUBs reflow); its chapters' headings name the sections
    assert (listed["handbook.epub"]["format"], listed["handbook.epub"]["pages"]) == ("epub", 0)
    book = json.loads(run_cli("show", "handbook.epub", "--archive", arc, "--json", check=True).stdout)
    assert {"pages": None, "section": "Maintenance", "sections": None, "rows": None} in book["sources"], book["sources"]
    # a workbook's visible sheets are its sections (no pages): each segment names the sheet it came from
    assert (listed["budget.xlsx"]["format"], listed["budget.xlsx"]["pages"]) == ("xlsx", 0)
    sheets = json.loads(run_cli("show", "budget.xlsx", "--archive", arc, "--json", check=True).stdout)["sources"]
    assert {s["section"] for s in sheets} == {"Service costs", "Notes"}, sheets  # hidden and empty sheets left out
    # and the rows it holds, as the sheet numbers them (the header is row 1; the notes sheet's lines are no rows)
    cost_rows = [s["rows"] for s in sheets if s["section"] == "Service costs"]
    assert cost_rows[0][0] == 2 and cost_rows[-1][1] == 32 and all(a <= b for a, b in cost_rows), sheets
    assert [s["rows"] for s in sheets if s["section"] == "Notes"] == [None]
    assert listed["parts.csv"]["format"] == "csv" and listed["log.odt"]["format"] == "odt"
    notebook = json.loads(run_cli("show", "trials.ipynb", "--archive", arc, "--json", check=True).stdout)
    assert notebook["format"] == "ipynb" and notebook["sources"] == [{"pages": None, "section": "Sonar trials", "sections": None,
                                                                      "rows": None}], notebook
    assert notebook["tokens"] < 30, notebook  # the prose and the code, not the plot's 3,000 base64 characters
    log = json.loads(run_cli("show", "log.odt", "--archive", arc, "--json", check=True).stdout)
    assert log["sources"] == [{"pages": None, "section": "Dock log", "sections": None, "rows": None}], log
    parts = json.loads(run_cli("show", "parts.csv", "--archive", arc, "--json", check=True).stdout)
    assert parts["sources"] == [{"pages": None, "section": None, "sections": None, "rows": [2, 3]}], parts
    (key,) = parts["segments"]
    table = json.loads(run_cli("show", key, "--archive", arc, "--json", check=True).stdout)["text"]
    assert table == "| Part | Cost (EUR) |\n|---|---|\n| Seal kit | 11,75 |\n| Impeller | 1011,25 |", table
    human = run_cli("show", "briefing.pptx", "--archive", arc, check=True).stdout
    assert re.search(r"^format: pptx$", human, re.M) and re.search(r"^pages: 6$", human, re.M)
    assert re.search(r"^  [0-9a-f]{12}  p\. 3 § Service costs$", human, re.M), human
    count = re.search(r"^segments: (\d+)$", human, re.M)  # a count, and then each key a line with its source
    assert count and len(re.findall(r"^  [0-9a-f]{12}  ", human, re.M)) == int(count[1]) == 5, human
    human = run_cli("show", "budget.xlsx", "--archive", arc, check=True).stdout
    assert re.search(r"^  [0-9a-f]{12}  § Service costs rows 2-\d+$", human, re.M), human
    # when, as people read it (the JSON keeps epoch seconds)
    assert re.search(r"^ingested: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+ \((just now|\d+[mhd] ago)\)$", human, re.M), human

    proc = run_cli("query", QUESTION, "--archive", arc, "--top-k", "1", "--max-tokens", "16", check=True)
    answer, sources = proc.stdout.rstrip("\n").rsplit("\n", 1)
    assert answer.strip() == result.answer.strip()  # the answer as before, then its sources
    assert sources == "Sources: manual.pdf p. 3 § Operating limits"
    # a spreadsheet's passage cites its rows, in the CLI's JSON as in its Sources line
    proc = run_cli("query", "What does the impeller cost?", "--archive", arc, "--doc", "parts.csv", "--doc",
                   "standup.vtt", "--max-tokens", "1", "--json", check=True)
    sheet, talk = json.loads(proc.stdout)["segments"]
    assert (sheet["document"], sheet["rows"]) == ("parts.csv", [2, 3]), sheet
    assert (talk["document"], talk["section"]) == ("standup.vtt", "00:00:02-00:00:09"), talk
