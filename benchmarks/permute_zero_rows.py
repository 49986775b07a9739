"""``permute`` forward with its zero rows located from the group sizes, against scanned (CUDA).

``PYTHONPATH=. python benchmarks/permute_zero_rows.py``: 64 experts, top-8, random routing,
bf16. The library's scatter zeroes the rows no slot holds from the padded group sizes and
the per-expert counts; the other variant hands it no counts, so it finds those rows by
reading every row's token in programs after the copying ones (the earlier way). Three
alternating rounds of ``do_bench`` each, microseconds, beside the byte floor at 4.27 TB/s
(each token row read once, every output row written once); both outputs must be equal.
"""

import statistics

import torch
from triton.testing import do_bench

import grouped_linear as gl
from grouped_linear.kernels import layout

COPY_BYTES_PER_S = 4.267e12
located = layout.scatter_rows


def scanned(src, row_map, token_of_row, groups=None):
    return located(src, row_map, token_of_row, None)


def main():
    torch.manual_seed(0)
    for hidden, rows in ((4096, 65536), (7168, 65536), (4096, 131072)):
        tokens = rows // 8
        indices = torch.randn(tokens, 64, device="cuda").topk(8, dim=-1).indices
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        for multiple in (1, 16, 128):
            times = {"located": [], "scanned": []}
            outputs = {}
            for _ in range(3):
                for mode, scatter in (("located", located), ("scanned", scanned)):
                    layout.scatter_rows = scatter
                    outputs[mode] = gl.permute(x, indices, 64, multiple=multiple)[0]
                    times[mode].append(1e3 * do_bench(
                        lambda x=x, i=indices, m=multiple: gl.permute(x, i, 64, multiple=m),
                        warmup=300, rep=200, return_mode="median"))
            layout.scatter_rows = located
            same = torch.equal(outputs["located"], outputs["scanned"])
            floor = (tokens + outputs["located"].shape[0]) * hidden * 2 / COPY_BYTES_PER_S * 1e6
            print(f"H={hidden} rows={rows} multiple={multiple}: located "
                  f"{statistics.median(times['located']):.1f} µs, scanned "
                  f"{statistics.median(times['scanned']):.1f} µs, floor {floor:.1f} µs, "
                  f"equal {same}")


if __name__ == "__main__":
    main()
