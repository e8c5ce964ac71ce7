"""Step time before launch: one training step simulated from the optimized, scheduled HLO of the deviceless GPU
compile (read by MaxOffload/hlo.py; each kernel's matmul FLOPs counted as the compiled-work audit counts them).

The modules: engines.py (the engines, a target's Rates, the Event), schedule.py (what each instruction of the
schedule is and moves, replica groups), simulate.py (the Simulation; simulate and of_compiled, the entry points),
summary.py (the report dict and its lines), trace.py (the Perfetto trace, the files the aot tool writes) and
plot.py (one layer's window as a PNG). This __init__ exposes nothing: import from those modules.

The engines, each its own queue (seconds):
  compute     runs the scheduled instructions in order: the entry computation, a while loop's condition and body
              x its trip count, a conditional's dearest branch, called computations inline. A kernel (fusion,
              custom call, dot, copy, ...) costs the larger of its matmul FLOPs at the achievable matmul rate and
              its HBM bytes (operands + result from the shapes in the HLO, pinned-host buffers excluded; the slice a
              fused dynamic-slice reads, the update an in-place dynamic-update-slice writes) at the achievable HBM
              rate.
  d2h, h2d    transfers to and from pinned host memory (buffers in memory space S(5)), full duplex, at the host
              link's achievable rate. An async transfer (start ... done) queues behind the earlier ones of its
              direction when its start is reached; its done stalls compute until it has finished. A synchronous one
              stalls compute for all of it.
  collective  all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute over their replica
              groups' links: NVLink inside an NVLink domain (hardware.nvlink_domain GPUs of a slice), the network
              across. Of the gathered output (all-gather) or the input (reduce-scatter, all-to-all, a ragged
              all-to-all's first operand: what it may send; twice for all-reduce) a device moves (n - 1) / n: the
              share of members in other domains over the network, the rest over NVLink, both at once
              (hierarchical). A permute moves its operand. Async ones (start ...
              done) run beside compute, synchronous ones stall it.
What a stall waits for is exposed time: step = compute + exposed copy + exposed collective time (+ what is still in
flight when the last instruction ends). Each event keeps its instruction's name, its op name's models/components
part and its layer segment (layers_A_B), so the figures split per segment and the trace reads beside a profile.

Calibration: three constants, the achievable shares of the target's peaks (hardware.CALIBRATION: where they were
measured is said there; benchmarks/predict_vs_measured.py checks them against measured step times). Assumptions: kernels of
one stream never overlap each other; a kernel reaches the same share of the peak whatever its shape; async device
computations (not transfers, not collectives) run on the compute stream; replica-group device ids are taken as
global ids in slice-major order (the order MaxOffload/parallel/mesh.py builds).
"""
