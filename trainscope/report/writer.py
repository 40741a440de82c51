"""The report's section writer: each section to report.md, report.pdf, and its own figures and .tex tables."""

from pathlib import Path

from trainscope.core.record_view import RunView, warning_lines
from trainscope.core.records import write_text_atomic
from trainscope.core.results_view import machines_text
from trainscope.report.book import Book
from trainscope.report.sections import machines
from trainscope.report.tables import Table, save_figure


class ReportWriter:
    """Each section goes to report.md, to report.pdf, and to its own PNG/PDF figures and .tex tables; its answer and
    machines are declared (`answer`) before it is written (docs/benchmarks.md#the-committed-report)."""

    QUESTIONS = "The assignment's questions, answered"
    ANSWERS = "At a glance"
    SEVERAL = "Measured on several machines (each section says which figure comes from which)"
    UNNAMED = "Measured on a machine its inputs do not name"
    NONE = "Not measured (not run yet, or skipped)"

    def __init__(self, out: Path, book: Book):
        self.out = out
        self.book = book
        self.markdown: list[str] = []
        self.files: list[Path] = []
        self.figure_runs: dict[str, list[dict]] = {}  # figure name -> the records it shows
        self.answers: dict[str, object] = {}  # section title -> its Headline, or the line saying why there is none
        self.questions: list[tuple[str, str, object]] = []  # (question, section title, [Answer] or why none)
        self.machines: dict[str, dict] = {}  # section title -> {Machine: what it measured}
        self.current: dict = {}  # the machines of the section being written (or of its part)
        self.section: str | None = None  # the title of the section being written
        self._answers_at: int | None = None  # where the answers go in the Markdown
        self._questions_at: int | None = None  # where the questions' answers go in the Markdown

    def title(self, title: str, line: str):
        self.markdown += [f"# {title}", "", line, ""]
        self.book.heading(title, level=1)
        self.book.text(line)

    def answers_page(self):
        """The first page: the assignment's questions, each answered in sentences with the page of its evidence;
        then one line per section, grouped by the machine that measured it; filled in once every section is
        written."""
        intro = (
            "What each experiment found: its headline figure and its verdict, worded as its section words them "
            "(under the section's heading, 'In short'), and the page the section is on; grouped by the machine "
            "that measured it, since figures from different machines are not comparable."
        )
        self.markdown += [f"## {self.QUESTIONS}", ""]
        self._questions_at = len(self.markdown)
        self.markdown += [f"## {self.ANSWERS}", "", intro.replace(", and the page the section is on", ""), ""]
        self._answers_at = len(self.markdown)
        self.book.heading(self.QUESTIONS)
        self.book.table_of_pages(lambda pages=None: [self.questions_table(pages)], 7.5)
        self.book.heading(self.ANSWERS)
        self.book.text(intro)
        self.book.table_of_pages(self.answers_tables, 7.5)
        self.book.page_break()

    def question(self, question: str, title: str, answers) -> None:
        """One of the assignment's questions, answered by the section `title` ([sections.Answer], or the line
        saying why it has none)."""
        self.questions.append((question, title, answers))

    def questions_table(self, pages: dict | None = None) -> Table:
        """Each question, its answers (each with the machine that measured it) and, with `pages`, where the
        evidence is."""
        rows = []
        for question, title, answers in self.questions:
            if isinstance(answers, str):
                text = answers
            else:
                text = " ".join(
                    f"{a.text.rstrip('.')} (measured on {a.machine.text})." if a.machine else a.text for a in answers
                )
            asked = f"{question} (section: {title})"
            rows.append([asked, text] + ([str(pages.get(title, "?"))] if pages is not None else []))
        headers = ["question", "answer, and the machine that measured it"] + (["page"] if pages is not None else [])
        return Table("Each in a few sentences, with the page of its evidence", headers, rows, "questions",
                     "llr" if pages is not None else "ll")  # fmt: skip

    def answer(self, title: str, headline, machines: dict | None = None):
        """Declare a section's answer (a Headline, or the line saying why it has none) and the machines its
        figures come from ({Machine: what it measured}) before it is written. A section whose figures stand alone
        per machine may answer once per machine ({Machine: Headline}): each answer goes to its machine's group on
        the first page and under that machine's heading in the section (`part`)."""
        self.answers[title] = headline
        self.machines[title] = machines or {}

    def answer_groups(self) -> list[tuple[str, list[tuple[str, object]]]]:
        """(what measured them, [(section title, its answer)]): one group per machine in the order the sections
        first name it, then the sections measured on several machines, those whose inputs name none, and those not
        measured. A section that answers once per machine is in each of its machines' groups."""
        groups: dict[str, list] = {}
        for title, answer in self.answers.items():
            if isinstance(answer, dict):
                for machine, headline in answer.items():
                    groups.setdefault(self._group({machine: []} if machine else {}, headline), []).append(
                        (title, headline)
                    )
            else:
                groups.setdefault(self._group(self.machines.get(title) or {}, answer), []).append((title, answer))
        last = (self.SEVERAL, self.UNNAMED, self.NONE)
        order = [label for label in groups if label not in last] + [label for label in last if label in groups]
        return [(label, groups[label]) for label in order]

    def _group(self, machines: dict, answer) -> str:
        if len(machines) == 1:
            return f"Measured on {next(iter(machines)).text}"
        return self.SEVERAL if machines else self.UNNAMED if hasattr(answer, "verdict") else self.NONE

    def answers_tables(self, pages: dict | None = None) -> list[Table]:
        """One table per group of `answer_groups`, titled by its machine; with `pages`, the page of each section."""

        tables = []
        for label, answers in self.answer_groups():
            rows = []
            for title, answer in answers:
                text, verdict = (answer.text, answer.verdict) if hasattr(answer, "verdict") else (answer, "")
                if len(self.machines.get(title) or {}) > 1 and not isinstance(self.answers[title], dict):
                    text += f" (measured on {machines_text(self.machines[title])})"
                rows.append([title, text, verdict] + ([str(pages.get(title, "?"))] if pages is not None else []))
            headers = ["experiment", "answer", "verdict"] + (["page"] if pages is not None else [])
            tables.append(
                Table(
                    f"{label}: what each experiment found",
                    headers,
                    rows,
                    "answers",
                    "lllr" if pages is not None else "lll",
                )
            )
        return tables

    def begin(self, title: str, inputs, missing_line: str) -> bool:
        """Open a section; when its inputs are missing, write `missing_line` (which make target produces
        them) and return False. Else the machines its figures come from, then its answer."""

        self.markdown += [f"## {title}", ""]
        self.book.heading(title, anchor=title)
        self.section = title
        self.current = self.machines.get(title) or {}
        if not inputs:
            self.text(missing_line)
            return False
        if self.current:
            line = f"**Measured on:** {machines_text(self.current)}."
            self.markdown += [line, ""]
            self.book.text(line)
        self._in_short(self.answers.get(title))
        return True

    def _in_short(self, answer):
        if hasattr(answer, "verdict"):
            line = f"**In short:** {answer.text}. Verdict: {answer.verdict}."
            self.markdown += [line, ""]
            self.book.text(line, tint="#e9f0f8")

    def part(self, title: str, machines: dict | None = None):
        """A part of the section being written, under a heading of its own (e.g. one machine's results where the
        section shows several): with `machines` ({Machine: what it measured}; {} for none known) its figures'
        captions and tables' titles name those machines, not the section's, until the next part or section; where the
        section answers once per machine, this machine's answer follows the heading ('In short')."""
        self.markdown += [f"### {title}", ""]
        self.book.heading(title, level=3)
        if machines is not None:
            self.current = machines
        answer = self.answers.get(self.section)
        if isinstance(answer, dict) and len(machines or {}) == 1:  # the section answers for this machine here
            self._in_short(answer.get(next(iter(machines))))

    def measured_on(self, records=None) -> str:
        """'measured on AMD EPYC, AVX2, bf16 emulated, 2 cores': the machines of `records` where given, else the
        section's; '' where none is known."""
        grouped = machines([(RunView(r).name, r) for r in records]) if records else self.current
        return f"measured on {machines_text(grouped)}" if grouped else ""

    def text(self, line: str):
        self.markdown += [line, ""]
        self.book.text(line)

    def figure(self, figure, name: str, caption: str, records=()):
        """A figure, then the health warnings of the runs it shows."""

        on = self.measured_on(records)
        caption = f"{caption} ({on})" if on else caption
        self.markdown += [f"![{caption}]({name}.png)", "", f"*{caption}*", ""]
        width, height = figure.get_size_inches()
        self.files += save_figure(figure, self.out / name, bbox_inches="tight")
        self.book.image(self.out / f"{name}.pdf", caption, aspect=height / width)
        self.figure_runs.setdefault(name, []).extend(records)
        lines = warning_lines(records)
        if lines:
            self.text("Warnings for these figures:\n" + "\n".join(f"- {line}" for line in lines))

    def table(self, table: Table):

        on = self.measured_on()
        if on:
            table = Table(f"{table.title} ({on})", table.headers, table.rows, table.label, table.align)
        path = self.out / f"{table.label}.tex"
        write_text_atomic(path, table.latex())
        self.files.append(path)
        self.markdown += [f"**{table.title}** (LaTeX: `{path.name}`)", "", table.markdown(), ""]
        self.book.table(table)

    def code(self, text: str, language: str = ""):
        self.markdown += [f"```{language}", text, "```", ""]
        self.book.code(text)

    def appendix(self, lines: list[str]):
        """A closing part given as Markdown lines: its '## ' heading, then its lines as one block of text."""
        self.markdown += lines
        self.book.heading(lines[0].lstrip("# "))
        self.book.text("\n".join(line for line in lines[1:] if line))

    def close(self):
        """Fill in the answers, then lay out and draw the PDF."""
        if self._answers_at is not None:
            self.markdown[self._answers_at : self._answers_at] = [
                line for table in self.answers_tables() for line in (f"**{table.title}**", "", table.markdown(), "")
            ]
        if self._questions_at is not None:
            self.markdown[self._questions_at : self._questions_at] = [self.questions_table().markdown(), ""]
        self.book.close()
