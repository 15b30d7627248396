"""`cluster convert`: a Qwen3.5 checkpoint to an MLX directory that keeps the MTP head."""

from __future__ import annotations

from pathlib import Path

import click

from cluster.config import ModelDirError
from cluster.model.convert import DTYPES, ConvertError, convert


@click.command("convert")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--q-bits", type=click.Choice(["4", "8"]), help="Quantize to this many bits.")
@click.option(
    "--q-group-size",
    type=click.Choice(["32", "64", "128"]),
    default="64",
    show_default=True,
    help="Quantization group size.",
)
@click.option("--dtype", type=click.Choice(DTYPES), help="Cast the weights (default: as SRC).")
@click.option("--force", is_flag=True, help="Replace DST if it is not empty.")
@click.option(
    "--mtp-from",
    metavar="DIR|OWNER/NAME",
    default=None,
    help="Graft the MTP head of this checkpoint (the original Hugging Face release, a "
    "directory or repo id) into DST, quantized as DST: for SRC without mtp.* tensors, such as "
    "mlx-community's conversions.",
)
def convert_command(
    src: Path,
    dst: Path,
    q_bits: str | None,
    q_group_size: str,
    dtype: str | None,
    force: bool,
    mtp_from: str | None,
) -> None:
    """Convert the Qwen3.5 checkpoint SRC (Hugging Face or MLX) to an MLX directory DST that
    keeps the MTP head (SRC's, or with --mtp-from another checkpoint's)."""
    try:
        out = convert(
            src,
            dst,
            q_bits=int(q_bits) if q_bits else None,
            q_group_size=int(q_group_size),
            dtype=dtype,
            force=force,
            mtp_from=mtp_from,
        )
    except (ModelDirError, ConvertError) as error:
        raise click.ClickException(str(error)) from None
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    click.echo(f"wrote {out} ({size / 2**30:.2f} GiB)")
