"""report.pdf: the report for a reviewer to sign, from the same view as the HTML (reports.view).

Made with fpdf2 (pure Python, from PyPI, no system packages: it embeds TrueType fonts and PNGs itself).
The text is set in DejaVu Sans, which matplotlib (already a dependency) ships, because the PDF core
fonts cover Latin-1 only and the report writes σ, τ, ≥ and −. The charts are the view's PNGs. Every
page carries the provenance fingerprint and its page number in the footer, so that a printed page
still names the audit it belongs to; the last section is the sign-off block.
"""

from __future__ import annotations

import io
from pathlib import Path

from fpdf import FPDF
from fpdf.enums import XPos, YPos
from fpdf.fonts import FontFace
from matplotlib import get_data_path
from PIL import Image

from splitaudit.reports.documents import Document
from splitaudit.reports.view import ReportView
from splitaudit.reports.view_elements import Figure, Table

FONT_DIR = Path(get_data_path()) / "fonts" / "ttf"
FONTS = {"": "DejaVuSans.ttf", "B": "DejaVuSans-Bold.ttf", "I": "DejaVuSans-Oblique.ttf"}
MONO = "DejaVuSansMono.ttf"
VERDICT_COLOURS = {"pass": (220, 245, 226), "fail": (253, 226, 226), "neutral": (228, 236, 247)}
BODY, SMALL = 9.5, 7.5  # font sizes (pt)
IMAGE_DPI = 110  # how large a chart's pixels are drawn: its PNG at this many dots per inch, within the page


class ReportPDF(FPDF):
    """A4 pages with the fingerprint and page number in every footer."""

    def __init__(self, footer_text: str) -> None:
        super().__init__(format="A4")
        self.footer_text = footer_text
        for style, name in FONTS.items():
            self.add_font("DejaVu", style, str(FONT_DIR / name))
        self.add_font("DejaVuMono", "", str(FONT_DIR / MONO))
        self.set_auto_page_break(True, margin=16)
        self.set_margins(16, 14, 16)

    def footer(self) -> None:
        self.set_y(-11)
        self.set_font("DejaVu", "", SMALL)
        self.set_text_color(110)
        self.cell(0, 5, f"{self.footer_text} · page {self.page_no()}/{{nb}}", align="C")
        self.set_text_color(0)

    def heading(self, text: str, level: int = 1) -> None:
        """A section heading (level 1) or sub-heading, kept with at least a few lines after it."""
        size = {1: 14, 2: 11.5, 3: 10}[level]
        if self.will_page_break(size * 2.5):
            self.add_page()
        self.ln(3 if level > 1 else 5)
        self.set_font("DejaVu", "B", size)
        self.multi_cell(0, size * 0.5, text, new_x=XPos.LMARGIN, new_y=YPos.NEXT)
        self.ln(1)
        self.set_font("DejaVu", "", BODY)

    def paragraph(self, text: str, style: str = "", size: float = BODY) -> None:
        self.set_font("DejaVu", style, size)
        self.multi_cell(0, size * 0.5, text, new_x=XPos.LMARGIN, new_y=YPos.NEXT)
        self.ln(1.5)
        self.set_font("DejaVu", "", BODY)

    def boxed(self, text: str, colour: tuple[int, int, int], style: str = "B") -> None:
        self.set_fill_color(*colour)
        self.set_font("DejaVu", style, BODY + 1)
        self.multi_cell(0, 6, text, fill=True, padding=2, new_x=XPos.LMARGIN, new_y=YPos.NEXT)
        self.ln(2)
        self.set_font("DejaVu", "", BODY)

    def table_of(self, table: Table | None) -> None:
        """A view table, its columns as wide as their text (within limits); a two-column table without
        headers is a list of facts (label, value). Words longer than their column break anywhere."""
        if table is None or not table.rows:
            return
        self.set_font("DejaVu", "", SMALL + 0.5)
        headed = any(table.headers)
        rows = ([table.headers] if headed else []) + table.rows
        self.set_fill_color(255)
        with self.table(
            first_row_as_headings=headed,
            col_widths=column_widths(rows),
            text_align="LEFT",
            line_height=3.6,
            padding=1,
            headings_style=FontFace(emphasis="BOLD", fill_color=(232, 236, 241)),
        ) as pdf_table:
            for row in rows:
                cells = pdf_table.row()
                for value in row:
                    cells.cell(str(value))
        self.ln(2)
        self.set_font("DejaVu", "", BODY)

    def figure_size(self, figure: Figure | None, width_share: float = 1.0) -> tuple[float, float]:
        """A figure's (width, height) in mm: its PNG at IMAGE_DPI, never wider than width_share of the text."""
        if figure is None or not figure.png:
            return 0.0, 0.0
        pixels_w, pixels_h = Image.open(io.BytesIO(figure.png)).size
        width = min(self.epw * width_share, pixels_w / IMAGE_DPI * 25.4)
        return width, width * pixels_h / pixels_w

    def keep_together(self, height: float) -> None:
        """A new page unless `height` mm (a heading and its figure) fit on this one."""
        if self.will_page_break(height):
            self.add_page()

    def figure(self, figure: Figure | None, width_share: float = 1.0) -> None:
        """A chart or image grid, at IMAGE_DPI, never wider than width_share of the text width."""
        if figure is None or not figure.png:
            return
        width, height = self.figure_size(figure, width_share)
        self.keep_together(height)
        self.image(io.BytesIO(figure.png), x=self.l_margin, w=width, h=height, alt_text=figure.alt)
        self.ln(2)


def column_widths(rows: list[list]) -> tuple[float, ...]:
    """Relative column widths: each column's longest text and a little, between 10 and 60 characters."""
    return tuple(min(max(10, *(len(str(row[i])) + 2 for row in rows)), 60) for i in range(len(rows[0])))


def render_pdf(view: ReportView) -> bytes:
    """The report as PDF bytes, section by section in the HTML's order, then provenance and sign-off."""
    fingerprint = view.provenance.fingerprint if view.provenance else "no provenance recorded"
    pdf = ReportPDF(f"{view.title} · fingerprint {fingerprint}")
    pdf.set_title(f"{view.title} · {view.subtitle}")
    pdf.set_creator("splitaudit")
    pdf.add_page()
    _cover(pdf, view)
    _bounds(pdf, view)
    _attacks(pdf, view)
    _limitations(pdf, view)
    _run(pdf, view)
    _provenance(pdf, view)
    return bytes(pdf.output())


def _cover(pdf: ReportPDF, view: ReportView) -> None:
    pdf.paragraph(view.title, "B", 16)
    pdf.paragraph(view.subtitle, "", SMALL + 1)
    if view.provenance:
        pdf.paragraph(f"Fingerprint {view.provenance.fingerprint} (splitaudit verify report.json checks it)", "B")
    pdf.boxed(view.headline, VERDICT_COLOURS.get(view.verdict_class, VERDICT_COLOURS["neutral"]))
    for alert in view.alerts:
        pdf.boxed(alert, (255, 243, 205), "")
    pdf.heading("Summary")
    for item in view.summary:
        pdf.set_font("DejaVu", "B", BODY)
        pdf.multi_cell(0, 4.8, item.label, new_x=XPos.LMARGIN, new_y=YPos.NEXT)
        pdf.paragraph(item.text)
    if view.overview:
        pdf.heading("Attacks at a glance", 2)
        pdf.paragraph(
            "Advantage: how much better the attacker does with the bottom model than without it (0 or less: no advantage; an INCONCLUSIVE attack did not learn and measured nothing)."
        )
        pdf.table_of(view.overview)
    if view.gate:
        pdf.heading("Gate checks", 2)
        pdf.table_of(view.gate)


def _bounds(pdf: ReportPDF, view: ReportView) -> None:
    b = view.bounds
    if b is None:
        return
    pdf.heading("What can provably be recovered")
    pdf.paragraph(
        "Fisher information leakage (dFIL) measures how sharply an embedding pins down its input. It implies a "
        "floor on any attacker's reconstruction error (mean squared error per input dimension)."
    )
    if b.violated_by:
        pdf.boxed(
            f"Bound violated by {', '.join(b.violated_by)}: the bound cannot be trusted here. Likely causes: "
            + "; ".join(b.violation_causes),
            VERDICT_COLOURS["fail"],
        )
    pdf.table_of(b.bounds)
    if b.chart:
        pdf.keep_together(pdf.figure_size(b.chart)[1] + 14)
        pdf.heading("Attacks against the bound", 2)
        pdf.figure(b.chart)
    if b.dfil or b.dfil_chart or b.dfil_note:
        pdf.keep_together(pdf.figure_size(b.dfil_chart)[1] + 14)
        pdf.heading("Fisher information leakage per sample", 2)
        if b.dfil_note:
            pdf.paragraph(b.dfil_note, "B")
        pdf.figure(b.dfil_chart)
        pdf.table_of(b.dfil)
    if b.leakiest:
        pdf.heading("Leakiest samples", 2)
        pdf.table_of(b.leakiest)
    if b.prior:
        pdf.heading("Prior term", 2)
        pdf.table_of(b.prior)


def _attacks(pdf: ReportPDF, view: ReportView) -> None:
    if not view.attacks:
        return
    pdf.heading("Attacks")
    for a in view.attacks:
        state = (a.outcome_words or a.status).upper() + (" · BEATS THE BOUND" if a.beats_bound else "")
        pdf.heading(f"{a.title} ({state})", 2)
        if a.assumptions:
            pdf.paragraph(f"Threat model: {a.assumptions}", "I", SMALL + 1)
        if a.status != "ok":
            pdf.paragraph(f"{'Failed' if a.status == 'failed' else 'Not run'}: {a.reason or 'no reason given'}", "B")
            continue
        pdf.table_of(a.metrics)
        pdf.paragraph(a.advantage + (f" ({a.runs})" if a.runs else ""))
        if a.comparison:
            pdf.paragraph(a.comparison)
        if a.series:
            pdf.keep_together(pdf.figure_size(a.series_chart, 0.6)[1] + 12)
            pdf.heading(a.series_title, 3)
            pdf.figure(a.series_chart, 0.6)
            pdf.table_of(a.series)
        if a.reconstructions or a.examples:
            pdf.keep_together(pdf.figure_size(a.reconstructions, 0.6)[1] + 12)
            pdf.heading("Reconstructions" + (" (best, median, worst)" if a.reconstructions else ""), 3)
            pdf.figure(a.reconstructions, 0.6)
            pdf.table_of(a.examples)


def _limitations(pdf: ReportPDF, view: ReportView) -> None:
    """What the numbers assume and where they stop: the bounds' notes and the model's warnings."""
    notes = (view.bounds.notes if view.bounds else []) + view.warnings
    if not notes:
        return
    pdf.heading("Assumptions and limitations")
    for note in notes:
        pdf.paragraph(f"• {note}", "", SMALL + 1)


def _run(pdf: ReportPDF, view: ReportView) -> None:
    if not (view.not_run or view.model or view.data or view.run):
        return
    pdf.heading("The run")
    for title, table in (
        ("Attacks not run", view.not_run),
        ("Model", view.model),
        ("Data", view.data),
        ("Run", view.run),
    ):
        if table:
            pdf.heading(title, 2)
            pdf.table_of(table)


def _provenance(pdf: ReportPDF, view: ReportView) -> None:
    p = view.provenance
    pdf.heading("Provenance and sign-off")
    if p is None:
        pdf.paragraph("This result records no provenance (it was written before splitaudit recorded one).", "B")
        return
    pdf.paragraph(f"Fingerprint {p.fingerprint}: the files audited and the splitaudit version, by their SHA-256.", "B")
    pdf.table_of(p.files)
    pdf.paragraph(f"Command: {p.command_line}", "", SMALL + 1)
    pdf.table_of(p.run)
    pdf.table_of(p.versions)
    if pdf.will_page_break(70):
        pdf.add_page()
    pdf.heading("Sign-off", 2)
    pdf.paragraph(p.statement)
    pdf.set_font("DejaVu", "", BODY)
    for field in p.sign_off:
        pdf.cell(pdf.epw * 0.4, 11, field, border="B")
        pdf.cell(0, 11, "", border="B", new_x=XPos.LMARGIN, new_y=YPos.NEXT)


def write_pdf_document(document: Document, out_dir: Path) -> Path:
    """KIND.pdf: a report's view for a reviewer to sign."""
    return write_pdf(document.view, out_dir, document.kind)


def write_pdf(view: ReportView, out_dir: Path, stem: str = "report") -> Path:
    """STEM.pdf in out_dir, written as every report file is (reports.files.write_atomic)."""
    from splitaudit.reports.files import write_atomic

    return write_atomic(out_dir, f"{stem}.pdf", render_pdf(view))
