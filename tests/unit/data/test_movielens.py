"""MovieLens's three published layouts, read from tiny files fabricated in each (dpsweep.data.movielens),
and the loader's split and checks (dpsweep.data.loaders.load_movielens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fabricate import fabricate_movielens, movielens_ratings, whole

from dpsweep.config import MovieLensConfig
from dpsweep.data import loaders
from dpsweep.data.movielens import read_movielens
from dpsweep.errors import InputError

LAYOUTS = ["ratings.csv", "ratings.dat", "u.data"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_reads_every_users_ratings_in_item_order_with_the_catalogues_genres(
    tmp_path: Path, layout: str
) -> None:
    rows = movielens_ratings(users=12, items=9)
    fabricate_movielens(tmp_path, layout, rows[::-1])  # lines in any order
    data, path = read_movielens(tmp_path)
    assert path.name == layout and data.n_users == 12 and data.n_items == 9
    for u in range(12):
        mine = sorted((i, r) for user, i, r, _ in rows if user == u + 1)
        items, stars = data.row(u)
        assert items.tolist() == [i - 1 for i, _ in mine]  # item ids 1..9 are columns 0..8
        expected = [r if layout == "ratings.csv" else whole(r) for _, r in mine]
        assert stars.tolist() == expected
    assert data.item_features is not None and data.item_features.shape == (9, 3)
    assert data.item_features.sum(1).tolist() == [2.0 if i % 2 else 1.0 for i in range(1, 10)]  # 1 or 2 genres


CATALOGUES = {"ratings.csv": "movies.csv", "ratings.dat": "movies.dat", "u.data": "u.item"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_its_movies_file_a_folder_is_refused_naming_the_file(tmp_path: Path, layout: str) -> None:
    """Issue 54, item 4: without the catalogue the items would be the ids rated in the file, and one more user,
    the only rater of an item, would add an item to the released model (61 items against 60, the same ε)."""
    rows = [(1, 10, 4.0, 1), (1, 30, 2.0, 2), (2, 30, 5.0, 3), (2, 20, 1.0, 4)]
    fabricate_movielens(tmp_path, layout, rows, catalogue=False)
    with pytest.raises(InputError) as err:
        read_movielens(tmp_path)
    assert err.value.key == "dataset.root" and f"a folder holding {CATALOGUES[layout]} beside {layout}" in str(
        err.value
    ), str(err.value)
    fabricate_movielens(tmp_path, layout, rows, items=30)  # with it, every item of the catalogue, rated or not
    assert read_movielens(tmp_path)[0].n_items == 30


@pytest.mark.parametrize(
    ("layout", "line", "needle"),
    [
        ("u.data", "1\t2\n", "u.data:4: expected user, item, rating and timestamp, got '1\\t2'"),
        ("ratings.dat", "1::2::6::1\n", "ratings.dat:4: expected a rating of 0.5 to 5 stars"),
        ("ratings.csv", "1,99,3.0,1\n", "ratings.csv:4: expected an item of movies.csv"),
        ("ratings.csv", "1,x,3.0,1\n", "ratings.csv:4: expected user, item, rating and timestamp, got '1,x,3.0,1'"),
    ],
)
def test_a_malformed_line_is_refused_naming_the_file_and_the_line(
    tmp_path: Path, layout: str, line: str, needle: str
) -> None:
    path = fabricate_movielens(tmp_path, layout, movielens_ratings(users=3))
    lines = path.read_text(encoding="latin-1").splitlines(keepends=True)
    lines.insert(3, line)  # the file's fourth line
    path.write_text("".join(lines), encoding="latin-1")
    with pytest.raises(InputError) as err:
        read_movielens(tmp_path)
    assert err.value.key == "dataset.root" and needle in str(err.value), str(err.value)


def test_a_repeated_rating_is_refused_naming_its_line(tmp_path: Path) -> None:
    fabricate_movielens(tmp_path, "ratings.dat", [(1, 2, 3.0, 1), (2, 3, 4.0, 2), (1, 2, 5.0, 3)])
    with pytest.raises(InputError) as err:
        read_movielens(tmp_path)
    assert "ratings.dat:3: one rating per user and item" in str(err.value)


def test_the_loader_holds_users_out_and_checks_the_training_users(tmp_path: Path) -> None:
    fabricate_movielens(tmp_path, "u.data", movielens_ratings(users=12))
    with pytest.raises(InputError) as err:
        loaders.build(MovieLensConfig(root=str(tmp_path), num_users=100, held_out_users=2))
    assert err.value.key == "dataset.num_users" and str(err.value).startswith(
        "dataset.num_users=100 is invalid: 10: the training users of"
    )
    splits = loaders.build(MovieLensConfig(root=str(tmp_path), num_users=10, held_out_users=2))
    assert splits.n_train == 10 and len(splits.test) == 2 and splits.num_classes == 9
    test = splits.test
    assert isinstance(test, loaders.RatingsUsers) and test.held_out is not None
    assert (test.held_out.target.counts >= 1).all() and (test.held_out.history.counts >= 1).all()
    assert np.array_equal(splits.train[0][0].numpy(), splits.train.ratings.row(0)[0])  # type: ignore[attr-defined]


def test_missing_files_are_refused_naming_the_root_and_where_to_get_them(tmp_path: Path) -> None:
    with pytest.raises(loaders.DatasetNotFoundError) as err:
        loaders.build(MovieLensConfig(root=str(tmp_path / "nowhere")))
    assert err.value.key == "dataset.root" and "grouplens.org" in str(err.value)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda text: text + b"7,3,\xff\xfe,881250949\n",
            r"ratings.csv: utf-8 text, got the byte b'\\xff'",
        ),
        (
            lambda text: text + b'7,3,"' + b"x" * 200_000 + b'",1\n',
            r"ratings.csv:\d+: a CSV line of MovieLens \(field larger",
        ),
    ],
    ids=["invalid utf-8", "a 200,000-character field"],
)
def test_bytes_that_are_no_text_and_huge_fields_are_refused_naming_the_line(
    tmp_path: Path, damage: object, message: str
) -> None:
    """Issue 55, item 4: a ratings.csv with invalid UTF-8 or a field over csv's limit ended on a traceback."""
    path = fabricate_movielens(tmp_path, "ratings.csv", movielens_ratings(users=6))
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(InputError, match=message) as err:
        read_movielens(tmp_path)
    assert err.value.key == "dataset.root"
