"""The harness: runs every stage and the PyTorch SDPA peers on the same inputs and measures them.

``python -m harness compare`` (one problem, one table), ``sweep`` (grids of problems into
``results/<gpu>/runs.csv``), ``profile`` (DRAM bytes measured by Nsight Compute), ``inspect``
(compiled-code facts, no GPU needed) and ``device`` (the roofline ceilings of this GPU).

One measurement per module, so a reader finds each in one place:

=================  ==============================================================
module             what it measures / does
=================  ==============================================================
``inputs``         seeded q, k, v for a cell (the same for every impl in the cell)
``reference``      float64 reference attention, relative error, PyTorch's own error
``timing``         ms per call (CUDA events, the L2 flushed by a read; perf_counter on CPU)
``memory``         peak extra device memory of one call, bytes
``energy``         J per call and W from NVML's energy counter
``ncu``            DRAM bytes from Nsight Compute (``profile`` and ``compare --ncu``)
``inspect_code``   PTX instruction mix, registers/spills (ptxas), smem layouts
``op_count``       aten operations (launches) a piece of eager host code dispatches
``ceilings``       copy bandwidth and matmul rate of this GPU (``device``)
``device_info``    GPU name, driver, clocks, power limit -> env.json
``peers``          PyTorch SDPA forced to each backend
``impls``          what gets measured: stages, their ablation variants, peers
``measure``        one impl on one cell -> one results row (faults become statuses)
``table``          the rich table ``compare`` prints
``results``        the CSV/JSON schema (see its docstring for the columns)
=================  ==============================================================
"""
