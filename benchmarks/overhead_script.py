"""The yardstick of issue 57: dpsweep's default run as a user would write it by hand, Opacus and MLflow.

    .venv/bin/python benchmarks/overhead_script.py --epochs 8        # in a working directory of your choice

``benchmarks/overhead.py --vs-script`` times this script against ``dpsweep`` on its default config, both
pinned to one core. The training is dpsweep's default run: scikit-learn's digits upsampled to 28x28 and
scaled to [-1, 1] (the 80/20 stratified split of ``random_state=0``), the Opacus MNIST example CNN, SGD
(lr 0.05, momentum 0.9), ``PrivacyEngine().make_private`` with Poisson sampling (σ=1.0, C=1.0, B=64), an
evaluation on the 360 test images after every epoch. ``PrivacyEngine()`` keeps Opacus's default
accountant (PRV, Gopi et al. 2021), which is what a user who does not choose one gets; ε is at δ=1e-5.

The MLflow logging is what a user would write: one ``mlflow.start_run`` in a sqlite store
(``sqlite:///mlflow.db`` in the working directory, the store dpsweep's default run writes to), the
hyperparameters with ``log_params``, the epoch's mean training loss, test accuracy and ε with
``log_metrics`` after every epoch, and the final state dict as an artifact (``torch.save`` then
``log_artifact``). Everything is imported inside :func:`main`, at the top of the script as a user
would, so that the process pays for it.
"""

from __future__ import annotations

import argparse

SIGMA, MAX_GRAD_NORM, BATCH_SIZE, DELTA, LR, MOMENTUM = 1.0, 1.0, 64, 1e-5, 0.05, 0.9  # dpsweep's defaults


def main(epochs: int, seed: int) -> None:
    """Train the digits CNN with DP-SGD for ``epochs`` epochs, logging the run into ``sqlite:///mlflow.db``."""
    import tempfile
    from pathlib import Path

    import mlflow
    import numpy as np
    import torch
    import torch.nn.functional as F
    from opacus import PrivacyEngine
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class SampleConvNet(nn.Module):  # opacus/examples/mnist.py
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
            self.conv2 = nn.Conv2d(16, 32, 4, 2)
            self.fc1 = nn.Linear(32 * 4 * 4, 32)
            self.fc2 = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)
            return self.fc2(F.relu(self.fc1(x.flatten(1))))

    digits = load_digits()
    x, y = digits.images.astype(np.float32) / 16.0, digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)

    def images(a: np.ndarray) -> torch.Tensor:
        t = F.interpolate(torch.from_numpy(a).unsqueeze(1), size=(28, 28), mode="bilinear", align_corners=False)
        return (t - 0.5) / 0.5

    train_set = TensorDataset(images(x_tr), torch.from_numpy(y_tr))
    test_x, test_y = images(x_te), torch.from_numpy(y_te)

    mlflow.set_tracking_uri("sqlite:///mlflow.db")
    mlflow.set_experiment("digits-dpsgd-by-hand")
    torch.manual_seed(seed)
    model = SampleConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(train_set, batch_size=BATCH_SIZE),
        noise_multiplier=SIGMA, max_grad_norm=MAX_GRAD_NORM, poisson_sampling=True,
    )  # fmt: skip
    params = {"dataset": "digits", "model": "cnn", "noise_multiplier": SIGMA, "max_grad_norm": MAX_GRAD_NORM,
              "batch_size": BATCH_SIZE, "epochs": epochs, "lr": LR, "momentum": MOMENTUM, "delta": DELTA,
              "seed": seed}  # fmt: skip
    with mlflow.start_run():
        mlflow.log_params(params)
        for epoch in range(1, epochs + 1):
            model.train()
            losses = []
            for xb, yb in loader:
                if len(yb) == 0:  # Poisson sampling may draw an empty batch
                    continue
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            model.eval()
            with torch.no_grad():
                accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
            epsilon = engine.get_epsilon(DELTA)
            mlflow.log_metrics({"train_loss": sum(losses) / len(losses), "test_accuracy": accuracy,
                                "epsilon": epsilon}, step=epoch)  # fmt: skip
            print(f"epoch {epoch}/{epochs}: test_accuracy={accuracy:.4f} ε={epsilon:.3f}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "state_dict.pt"
            torch.save(model._module.state_dict(), path)  # the GradSampleModule's wrapped model
            mlflow.log_artifact(str(path))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="epochs (default 10, as dpsweep's default)")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed (default 0)")
    args = parser.parse_args()
    main(args.epochs, args.seed)
