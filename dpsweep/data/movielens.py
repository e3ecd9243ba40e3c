"""MovieLens ratings (GroupLens, https://grouplens.org/datasets/movielens/) read from their published
files, for ``task=recommender`` (no torch). Users download and unpack them; nothing is fetched.

    read_movielens(Path("data/ml-100k"))      # a folder holding one of the layouts below

The layouts, by the ratings file found in the folder (the first of these names):

- ``ratings.csv`` (ml-latest, ml-latest-small, ml-20m, ml-25m, ml-32m): a header
  ``userId,movieId,rating,timestamp``, then one rating a line (half stars, 0.5 to 5); the catalogue
  ``movies.csv``: ``movieId,title,genres`` (genres ``|``-separated; titles may be quoted);
- ``ratings.dat`` (ml-1m, ml-10m): ``UserID::MovieID::Rating::Timestamp``; ``movies.dat``:
  ``MovieID::Title::Genres`` (Latin-1);
- ``u.data`` (ml-100k): ``user<TAB>item<TAB>rating<TAB>timestamp``; ``u.item``: ``|``-separated, the
  item id first and its 19 genre flags last (Latin-1).

The catalogue gives the items (all of them, rated or not: a public list) in the order of their ids,
and each item's genres as public features (one 0/1 column per genre, in the order of the genres'
names). It must be there: without it the items would be the ids rated in the ratings file, a private
fact, since whether one user was the only rater of an item would show in the released model's number of
items (61 against 60, at the same ε); so a folder without it is refused as bad input, naming the file,
before any rating is read. A user's row lists their ratings in the order of the items' ids. A malformed
line, a rating outside 0.5 to 5, an item missing from the catalogue or a rating repeated is refused as
bad input (``dataset.root``), naming the file and the line.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpsweep.data.ratings import Ratings
from dpsweep.errors import InputError

KEY = "dataset.root"


@dataclass(frozen=True)
class Layout:
    """One published layout: its ratings file, how a line splits, its catalogue."""

    ratings: str
    separator: str
    header: bool
    catalogue: str
    catalogue_separator: str
    encoding: str


LAYOUTS = (
    Layout("ratings.csv", ",", True, "movies.csv", ",", "utf-8"),
    Layout("ratings.dat", "::", False, "movies.dat", "::", "latin-1"),
    Layout("u.data", "\t", False, "u.item", "|", "latin-1"),
)
ML100K_GENRES = 19  # u.item's last 19 fields: the genre flags


class MovieLensNotFound(InputError, FileNotFoundError):
    """No MovieLens ratings file in ``dataset.root``."""


def layout_of(root: Path) -> Layout:
    """The layout of the files in ``root``; MovieLensNotFound names what was looked for."""
    for layout in LAYOUTS:
        if (root / layout.ratings).is_file():
            return layout
    looked = ", ".join(layout.ratings for layout in LAYOUTS)
    raise MovieLensNotFound(
        KEY, str(root), f"a folder holding MovieLens ratings ({looked}): download and unpack one of the sets "
        "from https://grouplens.org/datasets/movielens/ there",
    )  # fmt: skip


def _bad(path: Path, line: int, what: str, text: str) -> InputError:
    return InputError(KEY, str(path.parent), f"{path.name}:{line}: {what}, got {text.strip()[:80]!r}")


def _lines(path: Path, separator: str, header: bool, encoding: str) -> Iterator[tuple[int, list[str], str]]:
    """(line number, fields, the line) of each data line of ``path``; InputError naming the line for bytes
    that are not ``encoding`` or a field longer than csv's limit (131,072 characters)."""
    number = 0
    try:
        with path.open(encoding=encoding, newline="") as f:
            if separator == ",":
                for number, fields in enumerate(csv.reader(f), start=1):
                    if number > 1 or not header:
                        yield number, fields, ",".join(fields)
            else:
                for number, text in enumerate(f, start=1):
                    if text.strip():
                        yield number, text.rstrip("\r\n").split(separator), text
    except UnicodeDecodeError as err:  # decoded a buffer at a time: the line is not known
        bad = err.object[err.start : err.start + 1]
        raise InputError(KEY, str(path.parent), f"{path.name}: {encoding} text, got the byte {bad!r}") from None
    except csv.Error as err:
        raise InputError(KEY, str(path.parent), f"{path.name}:{number + 1}: a CSV line of MovieLens ({err})") from None


def _catalogue(root: Path, layout: Layout) -> tuple[dict[int, int], np.ndarray]:
    """Item id -> column, and the items' genre features; InputError where the catalogue file is absent (the
    items are public only as the catalogue lists them: see the module docstring)."""
    path = root / layout.catalogue
    if not path.is_file():
        raise InputError(
            KEY, str(root), f"a folder holding {layout.catalogue} beside {layout.ratings} (the movies file of the "
            "same MovieLens set): without it the items would be those rated, and whether one user was the only "
            "rater of an item would show in their number; unpack the whole archive there",
        )  # fmt: skip
    ids: list[int] = []
    genres: list[set[str]] = []
    for number, fields, text in _lines(path, layout.catalogue_separator, layout.header, layout.encoding):
        try:
            ids.append(int(fields[0]))
            if layout.ratings == "u.data":
                flags = fields[-ML100K_GENRES:]
                if len(fields) < ML100K_GENRES + 2 or any(f not in ("0", "1") for f in flags):
                    raise ValueError
                genres.append({str(i) for i, f in enumerate(flags) if f == "1"})
            else:
                genres.append({g for g in fields[-1].split("|") if g and g != "(no genres listed)"})
        except (ValueError, IndexError):
            raise _bad(path, number, "expected an item id, its title and its genres", text) from None
    if len(set(ids)) != len(ids):
        raise InputError(KEY, str(root), f"{path.name}: an item id listed twice")
    order = np.argsort(ids, kind="stable")
    names = sorted(set().union(*genres)) if genres else []
    features = np.zeros((len(ids), max(len(names), 1)), dtype=np.float32)
    column = {name: j for j, name in enumerate(names)}
    for row, i in enumerate(order):
        for g in genres[i]:
            features[row, column[g]] = 1.0
    return {ids[i]: row for row, i in enumerate(order)}, features


def read_movielens(root: Path) -> tuple[Ratings, Path]:
    """Every user's ratings in ``root`` (users numbered in the order of their ids), and the ratings
    file read."""
    layout = layout_of(root)
    path = root / layout.ratings
    catalogue = _catalogue(root, layout)
    users: list[int] = []
    items: list[int] = []
    stars: list[float] = []
    lines: list[int] = []
    for number, fields, text in _lines(path, layout.separator, layout.header, layout.encoding):
        try:
            if len(fields) != 4:
                raise ValueError
            user, item, star = int(fields[0]), int(fields[1]), float(fields[2])
            int(fields[3])
        except ValueError:
            raise _bad(path, number, "expected user, item, rating and timestamp", text) from None
        if not 0.5 <= star <= 5.0:
            raise _bad(path, number, "expected a rating of 0.5 to 5 stars", text)
        if item not in catalogue[0]:
            raise _bad(path, number, f"expected an item of {layout.catalogue}", text)
        users.append(user)
        items.append(item)
        stars.append(star)
        lines.append(number)
    if not users:
        raise InputError(KEY, str(root), f"{path.name}: ratings (it holds none)")
    user_ids, user_rows = np.unique(np.asarray(users), return_inverse=True)
    column, item_features = catalogue
    item_columns = np.fromiter((column[i] for i in items), dtype=np.int64, count=len(items))
    n_items = len(column)
    order = np.lexsort((item_columns, user_rows))  # by user, then by item
    sorted_users, sorted_items = user_rows[order], item_columns[order]
    repeated = np.flatnonzero((np.diff(sorted_users) == 0) & (np.diff(sorted_items) == 0))
    if len(repeated):
        line = lines[int(order[repeated[0] + 1])]
        raise InputError(KEY, str(root), f"{path.name}:{line}: one rating per user and item (this one repeats one)")
    indptr = np.zeros(len(user_ids) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum(np.bincount(sorted_users, minlength=len(user_ids)))
    values = np.asarray(stars, dtype=np.float32)[order]
    return Ratings(indptr, sorted_items.astype(np.int64), values, n_items, item_features), path
