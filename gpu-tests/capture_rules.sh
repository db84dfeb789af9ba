# Which driver calls invalidate a global-mode stream capture, on the real driver (no hook):
#   bash gpu-tests/capture_rules.sh   (GPU machine, repository root)
B=$(mktemp -d); L=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}'); ln -s $L $B/libcuda.so
gcc -O1 -o $B/cr gpu-tests/capture_rules.c -I crates/vgpu-hook/tests/programs -L $B -lcuda && $B/cr
