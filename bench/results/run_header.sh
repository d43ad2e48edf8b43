# Sourced by the run.sh scripts under bench/results/: `run_header CMD...` prints what a result
# file starts with (when, on what CPU, at what load, from which commit, the command), then a
# blank line; `run_footer` the load average after the run.
run_header() {
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
    echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "commit: $(git rev-parse --short HEAD)"
    echo "command: $*"
    echo
}

run_footer() {
    echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
}
