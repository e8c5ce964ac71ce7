"""Step-window profiling (XProf / Nsight Systems) and the copy/compute overlap report."""
