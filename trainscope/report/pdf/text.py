"""The PDF book's text: its fonts, their measured glyph widths, and breaking text and code into lines that fit."""

from dataclasses import dataclass

# ---------------------------------------------------------------- the PDF book: fonts and line breaking

POINT = 1 / 72  # inch
LEADING = 1.3  # line height / font size
ASCENT, DESCENT = 0.928, 0.236  # DejaVu's ascender and descender, in font sizes
CONTINUED = "\u21aa "  # the mark of a code line broken to fit the page


@dataclass(frozen=True)
class Font:
    """A face and size the book draws with. Widths come from the font's own unhinted glyph advances and
    kerning (matplotlib's TextToPath), which is how the PDF backend places the glyphs, plus a margin
    for rounding; the tests hold them to the drawn glyphs' boxes."""

    size: float
    family: str = "DejaVu Sans"
    weight: str = "normal"
    style: str = "normal"

    @property
    def line(self) -> float:
        return self.size * LEADING

    def advances(self) -> "Advances":
        if self not in _ADVANCES:
            _ADVANCES[self] = Advances(self)
        return _ADVANCES[self]

    def width(self, text: str) -> float:
        """Points that `text` takes on one line."""
        return self.advances().width(text)

    def baseline(self, top: float, index: int) -> float:
        """The baseline of line `index` of a block whose top is `top` (points from the page's bottom)."""
        return top - index * self.line - (self.line - (ASCENT + DESCENT) * self.size) / 2 - ASCENT * self.size

    def properties(self):
        from matplotlib.font_manager import FontProperties

        return FontProperties(family=self.family, weight=self.weight, style=self.style, size=self.size)


class Advances(dict):
    """A font's advance (points) of each word measured, measured once; a line is its words' advances and its
    spaces' (kerning across a space is nil), with the margin."""

    MARGIN = (1.01, 0.5)  # times, plus points

    SCALE = 100.0  # the size (points at 72 dpi) measured at, as matplotlib's TextToPath does

    def __init__(self, font: Font):
        from matplotlib.font_manager import findfont, get_font

        super().__init__()
        self.face = get_font(findfont(font.properties()))
        self.scale = font.size / self.SCALE
        self.space = self[" "]

    def __missing__(self, word: str) -> float:
        from matplotlib.ft2font import LoadFlags

        self.face.set_size(self.SCALE, 72)  # the face is shared: sized on every use, as matplotlib does
        self.face.set_text(word, 0.0, flags=LoadFlags.NO_HINTING)
        value = self[word] = self.face.get_width_height()[0] / 64 * self.scale
        return value

    def fits(self, raw: float, width: float) -> bool:
        """Whether a line of `raw` advances fits `width`, the margin added."""
        return raw * self.MARGIN[0] + self.MARGIN[1] <= width + 1e-6

    def raw(self, text: str) -> float:
        words = text.split(" ")
        return sum(self[word] for word in words if word) + (len(words) - 1) * self.space

    def width(self, text: str) -> float:
        return self.raw(text) * self.MARGIN[0] + self.MARGIN[1] if text else 0.0


_ADVANCES: dict[Font, Advances] = {}


def wrap(text: str, width: float, font: Font) -> list[str]:
    """The lines of `text` within `width` points: words whole where they fit, a word wider than a line broken
    (after a '/', '-', '_', ',' or '=' near its end where there is one); a line's indent kept and a list
    item's text hung under its first word."""
    advances, lines = font.advances(), []
    for paragraph in text.split("\n"):
        body = paragraph.lstrip(" ")
        indent = paragraph[: len(paragraph) - len(body)]
        hang = indent + ("  " if body.startswith(("- ", "* ")) else "")
        limit = max(width - advances.width(hang), font.size)
        prefix, words, used = indent, [], advances.raw(indent)
        for word in body.split():
            if not advances.fits(advances[word], limit):  # alone it is too wide: lines of its own pieces
                if words:
                    lines.append(prefix + " ".join(words))
                    prefix, words = hang, []
                *whole, word = _break(word, limit, font)
                for piece in whole:
                    lines.append(prefix + piece)
                    prefix = hang
                used = advances.raw(prefix)
            elif words and not advances.fits(used + advances.space + advances[word], width):
                lines.append(prefix + " ".join(words))
                prefix, words, used = hang, [], advances.raw(hang)
            used += (advances.space if words else 0.0) + advances[word]
            words.append(word)
        lines.append(prefix + " ".join(words))
    return lines


def _break(word: str, width: float, font: Font) -> list[str]:
    pieces = []
    while font.width(word) > width + 1e-6:
        low, high = 1, len(word) - 1  # the longest head that fits (at least one character)
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if font.width(word[:middle]) <= width else (low, middle - 1)
        fit = low
        after = max(word.rfind(mark, 0, fit) for mark in "/-_,=")
        cut = after + 1 if after + 1 >= fit * 0.6 else fit
        pieces.append(word[:cut])
        word = word[cut:]
    return [*pieces, word]


def wrap_code(text: str, width: float, font: Font) -> list[str]:
    """Monospace lines within `width`, spaces kept; a longer line goes on, marked, on the next (broken at a
    space in its second half where there is one)."""
    per_line = max(20, int((width - 1.0) / (font.width("x" * 100) / 100)))
    lines = []
    for line in text.expandtabs(4).split("\n"):
        mark = ""
        while len(mark) + len(line) > per_line:
            room = per_line - len(mark)
            space = line.rfind(" ", room // 2, room)
            cut = space + 1 if space > 0 else room
            lines.append(mark + line[:cut])
            line, mark = line[cut:], CONTINUED
        lines.append(mark + line)
    return lines


def plain(text: str) -> str:
    """Markdown's inline marks as a reader sees them: code spans and emphasis without their backticks and stars."""
    return text.replace("`", "").replace("**", "")
