"""``dpsweep-epsilon``: statements, JSON, calibration, plots, and exit code 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_script
from PIL import Image

from dpsweep.cli.epsilon import main, run
from dpsweep.errors import InputError
from dpsweep.privacy import ledger, rdp, schedule

JSON_KEYS = {
    "mechanism", "epsilon", "delta", "alpha", "steps", "sample_rate", "noise_multiplier", "accountant", "conversion",
    "neighbours", "description", "epsilon_lower", "epsilon_upper", "mu_gdp", "gdp_delta_allowance", "tpr_at_1pct",
    "tpr_at_10pct", "mia_advantage",
}  # fmt: skip


def test_statement_for_the_mnist_reference(capsys: pytest.CaptureFixture[str]) -> None:
    run(["-s", "60000", "-b", "150", "-n", "1.3", "-e", "15", "--accountant", "rdp"])
    text = capsys.readouterr().out
    assert "q = 0.0025" in text and "6000 steps" in text and "ε = 0.724223" in text
    assert "δ = 1e-05" in text and "α = 19" in text and "RDP accountant, improved conversion" in text


def test_the_default_accountant_is_dp_accountings_pld(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33, item 5: by default ε is PLD's (the tightest sound accountant), as dp-accounting's own
    PLDAccountant gives it (pessimistic estimate, 1e-4 discretisation), and below RDP's 0.7242."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    run(["-s", "60000", "-b", "150", "-n", "1.3", "-e", "15", "--json"])
    out = json.loads(capsys.readouterr().out)
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    step = dp_event.PoissonSampledDpEvent(0.0025, dp_event.GaussianDpEvent(1.3))
    accountant.compose(dp_event.SelfComposedDpEvent(step, 6000))
    assert out["accountant"] == "pld" and out["alpha"] is None and out["conversion"] is None
    assert out["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9) and out["epsilon"] < 0.7242234026


@pytest.mark.parametrize(("conversion", "expected"), [("classic", 0.941870567), ("improved", 0.7242234026)])
def test_json_has_exactly_the_documented_keys(
    capsys: pytest.CaptureFixture[str], conversion: str, expected: float
) -> None:
    run(
        [
            "-s",
            "60000",
            "-b",
            "150",
            "-n",
            "1.3",
            "-e",
            "15",
            "--json",
            "--accountant",
            "rdp",
            "--conversion",
            conversion,
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out) == JSON_KEYS | {"epochs"}
    assert out["epsilon"] == pytest.approx(expected, rel=1e-6)
    assert (out["steps"], out["alpha"], out["accountant"], out["conversion"]) == (6000, 19, "rdp", conversion)


def test_custom_orders_and_steps(capsys: pytest.CaptureFixture[str]) -> None:
    # q = 0.01 (N=10000, B=100), σ=1, 300 steps, orders {2, 5, 10, 20, 100}: ε = 2.39 at α = 5
    run(["-s", "10000", "-b", "100", "-n", "1.0", "--steps", "300", "--alphas", "2", "5", "10", "20", "100", "--json",
         "--accountant", "rdp"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert round(out["epsilon"], 2) == 2.39 and out["alpha"] == 5 and out["sample_rate"] == 0.01


def test_tf_privacys_step_convention_reproduces_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33, item 4: TF Privacy counts q = B/N and ceil(epochs·N/B) steps; dpsweep trains Opacus's
    q = 1/ceil(N/B) and ceil(N/B) steps an epoch. Checked against dp-accounting's RDP accountant."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    args = ["-s", "60000", "-b", "256", "-n", "1.1", "-e", "60", "--json", "--accountant", "rdp"]
    run([*args, "--convention", "tf_privacy"])
    tf = json.loads(capsys.readouterr().out)
    run(args)
    opacus = json.loads(capsys.readouterr().out)
    assert (tf["steps"], tf["sample_rate"], tf["convention"]) == (14063, 256 / 60000, "tf_privacy")
    assert (opacus["steps"], opacus["sample_rate"]) == (14100, 1 / 235) and "convention" not in opacus
    accountant = rdp_privacy_accountant.RdpAccountant()
    step = dp_event.PoissonSampledDpEvent(256 / 60000, dp_event.GaussianDpEvent(1.1))
    accountant.compose(dp_event.SelfComposedDpEvent(step, 14063))
    assert tf["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)  # 2.5967
    assert round(opacus["epsilon"], 4) == 2.5927


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--mechanism", "dpftrl"], "--convention='tf_privacy' is invalid: opacus with --mechanism dpftrl"),
        (["--plot", "plots"], "--plot='plots' is invalid: left out with --convention tf_privacy"),
    ],
)
def test_the_tf_privacy_convention_is_refused_where_it_means_nothing(extra: list[str], needle: str) -> None:
    with pytest.raises(InputError) as refused:
        run(["-s", "60000", "-b", "256", "-n", "1.1", "-e", "6", "--convention", "tf_privacy", *extra])
    assert needle in str(refused.value)


def test_prv_has_no_order(capsys: pytest.CaptureFixture[str]) -> None:
    run(["-s", "60000", "-b", "150", "-n", "1.3", "-e", "15", "--accountant", "prv", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["alpha"] is None and out["conversion"] is None and out["epsilon"] < 0.7242234026


def test_target_epsilon_calibrates_sigma(capsys: pytest.CaptureFixture[str]) -> None:
    run(["-s", "60000", "-b", "256", "-e", "10", "--target-epsilon", "1.5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["calibrated"] == "noise_multiplier" and 1.49 <= out["epsilon"] <= 1.5
    pld = ledger.Accounting("pld")  # the default accountant
    again = schedule.epsilon(
        schedule.poisson_schedule(60000, 256), out["noise_multiplier"], 1e-5, epochs=10, accounting=pld
    )
    assert again.epsilon == out["epsilon"]


def test_target_epsilon_calibrates_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    run(["-s", "1437", "-b", "64", "-n", "1.0", "--target-epsilon", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    e = out["epochs"]
    assert out["calibrated"] == "epochs" and out["epsilon"] <= 4
    assert schedule.epsilon(schedule.poisson_schedule(1437, 64), 1.0, 1e-5, epochs=e + 1).epsilon > 4


def test_plots_are_valid_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run(["-s", "60000", "-b", "256", "-n", "1.1", "-e", "20", "--plot", str(tmp_path / "plots"), "--json"])
    names = sorted(Path(p).name for p in out["plots"])
    assert names == sorted(f"epsilon_vs_{k}.png" for k in ("epochs", "noise", "batch_size", "dataset_size", "delta"))
    for path in out["plots"]:
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size[0] >= 1200  # at print resolution (issue 33, item 8)
            assert round(img.info["dpi"][0]) == 300


@pytest.mark.slow
def test_vector_plots_embed_truetype_fonts(tmp_path: Path) -> None:
    """--plot-format pdf: vector figures whose fonts are TrueType (Type 42), not the Type 3 that
    matplotlib embeds by default and that publishers' checks reject (issue 33, item 8)."""
    out = run(["-s", "60000", "-b", "256", "-n", "1.1", "-e", "20", "--plot", str(tmp_path / "plots"),
               "--plot-format", "pdf", "--json"])  # fmt: skip
    assert len(out["plots"]) == 5
    for path in out["plots"]:
        pdf = Path(path).read_bytes()
        assert pdf.startswith(b"%PDF") and path.endswith(".pdf")
        assert b"/FontFile2" in pdf and b"/Type3" not in pdf, path  # a TrueType program embedded; no Type 3


BAD = [
    (["-s", "100", "-b", "150", "-n", "1", "-e", "1"], "-b/--batch-size=150 is invalid", "above 1"),
    (["-s", "1000", "-b", "10", "-n", "0", "-e", "1"], "-n/--noise-multiplier=0.0 is invalid", "a positive"),
    (["-s", "1000", "-b", "10", "-n", "-1", "-e", "1"], "-n/--noise-multiplier=-1.0 is invalid", "a positive"),
    (["-s", "1000", "-b", "10", "-n", "1", "-e", "1", "-d", "0"], "-d/--delta=0.0 is invalid", "(0, 1)"),
    (["-s", "1000", "-b", "10", "-n", "1", "-e", "1", "-d", "1.5"], "-d/--delta=1.5 is invalid", "(0, 1)"),
    (["-s", "1000", "-b", "10", "-n", "1", "-e", "1", "-d", "0.01"], "-d/--delta=0.01", "--allow-large-delta"),
    (["-s", "1000", "-b", "10", "-n", "1", "-e", "1", "--steps", "5"], "-e/--epochs or --steps", "not both"),
    (["-s", "1000", "-b", "10", "-n", "1"], "-e/--epochs or --steps", "length"),
    (["-s", "1000", "-b", "10", "-e", "1000", "--target-epsilon", "1e-9"], "--target-epsilon=1e-09", "reached"),
    (["-s", "1000", "-b", "500", "-n", "0.3", "--target-epsilon", "0.01"], "--target-epsilon=0.01", "one epoch"),
    (["-s", "1000", "-b", "10", "-n", "nan", "-e", "1"], "-n/--noise-multiplier=nan is invalid", "finite"),
    (["-s", "1000", "-b", "10", "-n", "inf", "-e", "1"], "-n/--noise-multiplier=inf is invalid", "finite"),
    # finite but absurd: σ² overflowed float64 in the accountant (a traceback before; issue 39, item 12)
    (["-s", "1000", "-b", "10", "-n", "1e300", "-e", "1"], "-n/--noise-multiplier=1e+300 is invalid", "to 1e+06"),
    (["-s", "1000", "-b", "10", "-n", "1e-300", "-e", "1"], "-n/--noise-multiplier=1e-300", "from 1e-06"),
    (["-s", "1000", "-b", "10", "-n", "1", "-e", "1", "--alphas", "nan"], "--alphas=[nan] is invalid", "finite"),
    (["-s", "1000", "-b", "10", "-e", "1", "--target-epsilon", "nan"], "--target-epsilon=nan is invalid", "finite"),
    (
        ["-s", "60000", "-b", "150", "-e", "15", "--target-epsilon", "2", "--conversion", "classic"],
        "--target-epsilon",
        "improved",
    ),
    (["-s", "1000", "-b", "10", "-n", "1", "-e", "1", "--tuning-trials", "1"], "--tuning-trials=1.0", "above 1"),
    (
        [
            "-s",
            "1000",
            "-b",
            "10",
            "-n",
            "1",
            "-e",
            "1",
            "--tuning-trials",
            "5",
            "--tuning-distribution",
            "tnb",
            "--tuning-eta",
            "-2",
        ],
        "--tuning-eta=-2.0",
        "η > 0",
    ),
    (
        ["-s", "1000", "-b", "10", "-n", "1", "-e", "1", "--clipping", "quantile", "--clip-epsilon", "0"],
        "--clip-epsilon=0.0",
        "a positive ε",
    ),
    (["-s", "1000", "-b", "10", "-n", "1", "-e", "1", "--alphas", "big"], "--alphas='big'", "default, opacus"),
    (
        ["--mechanism", "dpftrl", "-s", "100", "-b", "10", "-n", "1", "-e", "3", "--restart-every", "5"],
        "--restart-every=5",
        "from 1 to the run's 3 epochs",
    ),
    (["--mechanism", "dpftrl", "-s", "100", "-b", "10", "-n", "1", "--steps", "30"], "--steps=30", "left out"),
    (["-s", "100", "-b", "10", "-n", "1", "-e", "3", "--restart-every", "1"], "--restart-every=1", "dpftrl only"),
    (["-s", "1437", "-b", "64", "-n", "0.03", "-e", "8", "--accountant", "prv"], "--accountant='prv'", "rdp here"),
    (["-s", "1437", "-b", "64", "-n", "0.1", "-e", "8", "--accountant", "pld"], "--accountant='pld'", "above 100"),
]


@pytest.mark.parametrize(("argv", "flag", "allowed"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_exits_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str, allowed: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpsweep-epsilon: error: ") and flag in err and allowed in err, err


def test_a_quantile_clipping_release_is_priced_and_calibrated_with(capsys: pytest.CaptureFixture[str]) -> None:
    from dpsweep import config
    from dpsweep.privacy import clipping, ledger

    assert config.DPConfig().clip_epsilon == clipping.DEFAULT_EPSILON  # one default for the CLI and the config
    base = ["-s", "1437", "-b", "64", "-e", "8", "--json"]
    run([*base, "-n", "1"])
    plain = json.loads(capsys.readouterr().out)
    run([*base, "-n", "1", "--clipping", "quantile", "--clip-epsilon", "2"])
    priced = json.loads(capsys.readouterr().out)
    q = plain["sample_rate"]
    bill = ledger.Ledger((clipping.release(2.0, q, "histogram"), ledger.dpsgd(1.0, q, plain["steps"])))
    assert priced["epsilon"] == ledger.epsilon(bill, 1e-5, ledger.Accounting("pld")).epsilon > plain["epsilon"]
    run([*base, "--target-epsilon", "3", "--clipping", "quantile", "--clip-epsilon", "2"])
    calibrated = json.loads(capsys.readouterr().out)
    run([*base, "--target-epsilon", "3"])
    without = json.loads(capsys.readouterr().out)
    assert calibrated["epsilon"] <= 3 and calibrated["noise_multiplier"] > without["noise_multiplier"]


@pytest.mark.parametrize("distribution", ["poisson", "geometric", "tnb"])
def test_tuning_prints_the_procedures_epsilon_beside_the_single_runs(
    capsys: pytest.CaptureFixture[str], distribution: str
) -> None:
    from dpsweep.privacy import ledger

    argv = ["-s", "60000", "-b", "150", "-n", "1.3", "-e", "15", "--tuning-trials", "10"]
    run([*argv, "--tuning-distribution", distribution, "--json"])
    out = json.loads(capsys.readouterr().out)
    shape = 0.5 if distribution == "tnb" else ledger.TUNING_SHAPES.get(distribution)
    expected = ledger.tuning_epsilon(ledger.from_history([(1.3, 0.0025, 6000)]), 1e-5, 10, shape).epsilon
    assert out["epsilon_tuning"] == expected and out["epsilon_tuning"] > out["epsilon"]
    run([*argv, "--tuning-distribution", distribution])
    assert f"K ~ {distribution} with mean 10" in capsys.readouterr().out


def test_large_delta_can_be_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    run(["-s", "1000", "-b", "10", "-n", "1", "-e", "1", "-d", "0.01", "--allow-large-delta", "--json"])
    assert json.loads(capsys.readouterr().out)["delta"] == 0.01


@pytest.mark.slow
def test_console_script(tmp_path: Path) -> None:
    """The smoke test of the console script: a real process, its exit codes and its output."""
    ok = run_script("dpsweep-epsilon", "-s", "60000", "-b", "150", "-n", "1.3", "-e", "15", "--json", cwd=tmp_path)
    assert ok.returncode == 0 and json.loads(ok.stdout)["steps"] == 6000, ok.stdout + ok.stderr
    bad = run_script("dpsweep-epsilon", "-s", "60000", "-b", "150", "-n", "1.3", cwd=tmp_path)
    assert bad.returncode == 2 and "dpsweep-epsilon: error:" in bad.stderr, bad.stdout + bad.stderr


def test_opacus_orders_are_opacus_own() -> None:
    from opacus.accountants import RDPAccountant

    assert list(rdp.OPACUS_ORDERS) == list(RDPAccountant.DEFAULT_ALPHAS)


LIBRARIES = ("torch", "opacus", "mlflow", "pandas")  # seconds each to import
HEAVY = (*LIBRARIES, "hydra")


@pytest.mark.parametrize(
    ("module", "heavy"),
    [
        ("dpsweep.cli.epsilon", HEAVY),
        ("dpsweep.cli.plan", HEAVY),
        # these read dpsweep.config's defaults, which registers its schemas with Hydra (0.1 s)
        ("dpsweep.cli.report", LIBRARIES),
        ("dpsweep.cli.runs", LIBRARIES),
        ("dpsweep.cli.memory", LIBRARIES),
        ("dpsweep.cli.train", LIBRARIES),  # a Hydra app: Hydra is its --help
    ],
)
def test_commands_import_nothing_heavy_before_work(module: str, heavy: tuple[str, ...]) -> None:
    """Their --help and argument errors come before any heavy import (benchmarks/startup.py times them)."""
    import subprocess
    import sys

    probe = f"import sys, {module}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize(
    "call",
    [
        "from dpsweep.cli.epsilon import run; run(['-s', '60000', '-b', '256', '-n', '1.1', '-e', '10'])",
        "from dpsweep.cli.epsilon import run; run('-s 60000 -b 256 -n 1 -e 5 --accountant pld'.split())",
        "from dpsweep.cli.plan import main; main(['experiment=demo'])",
    ],
)
@pytest.mark.slow
def test_an_epsilon_query_and_a_plan_of_digits_import_no_torch(call: str) -> None:
    """Accounting is torch-free (issue 14): an ε query and planning the demo compute without torch or Opacus."""
    import subprocess
    import sys

    probe = f"import sys; {call}; print(sorted(m for m in {LIBRARIES!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


def test_report_help_names_the_formats_and_sort_keys_it_accepts() -> None:
    """dpsweep-report --help lists them without importing the report module: the same names."""
    from dpsweep.analysis.report import FIGURE_FORMATS, FORMATS, SORT_KEYS
    from dpsweep.cli.report import FIGURE_FORMAT_NAMES, FORMAT_NAMES, SORT_NAMES

    assert sorted(FORMAT_NAMES) == sorted(FORMATS.names())
    assert sorted(SORT_NAMES) == sorted(SORT_KEYS.names())
    assert FIGURE_FORMAT_NAMES == FIGURE_FORMATS


def test_dpftrl_is_priced_without_sampling_and_calibrated(capsys: pytest.CaptureFixture[str]) -> None:
    """DP-FTRL: ceil(N/B) batches per epoch, the tree's sensitivity, no sample rate; --target-epsilon calibrates σ."""
    from dpsweep.mechanisms import dpftrl_accounting

    argv = ["--mechanism", "dpftrl", "-s", "1437", "-b", "64", "-e", "6", "--restart-every", "2", "--json"]
    out = run([*argv, "-n", "4", "--tree-completion"])
    assert out["sample_rate"] is None and out["steps_per_epoch"] == 23 and out["steps"] == 138
    assert out["sensitivity_squared"] == dpftrl_accounting.ftrl_sensitivity_squared(23, 6, 2, True)
    expected = dpftrl_accounting.ftrl_epsilon(4.0, 23, 6, 1e-5, 2, True, accountant="pld")  # the default
    assert out["epsilon"] == pytest.approx(expected, rel=1e-12)
    pld = ledger.Accounting("pld")
    sgd = schedule.epsilon(schedule.poisson_schedule(1437, 64), 4.0, 1e-5, epochs=6, accounting=pld).epsilon
    assert out["epsilon"] > sgd  # no amplification by sampling
    calibrated = run([*argv, "--target-epsilon", "3", "--accountant", "pld"])
    assert calibrated["epsilon"] <= 3 and calibrated["calibrated"] == "noise_multiplier"
    assert dpftrl_accounting.ftrl_epsilon(0.99 * calibrated["noise_multiplier"], 23, 6, 1e-5, 2, accountant="pld") > 3
    capsys.readouterr()
    run([*argv[:-1], "-n", "4"])
    text = capsys.readouterr().out
    assert text.startswith("DP-FTRL with noise multiplier σ = 4") and "no sampling, no amplification" in text
