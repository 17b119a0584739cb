"""The course's command line: ``python -m course_lib <command>``.

    demo                 the headless tour (make demo)
    doctor               is this machine ready? versions, MPI, GPUs, a live 2-engine cluster
    gpu-check [--out D]  on a GPU: ceilings, MFU, memory models, CUDA tensors on every path
    bench allreduce ...  nccl-tests style tables: each allreduce against the native one
    bench hogwild ...    Hogwild! samples/s vs workers, lock-free vs locked, loss vs serial SGD
    bench ps ...         parameter-server throughput vs servers and workers, sync vs async
    bench ddp ...        data-parallel step time: each strategy vs torch DDP, bucket sweep
    bench pipeline ...   pipeline bubble vs (N-1)/(M+N-1), GPipe vs 1F1B
    bench zero ...       ZeRO memory per rank, bytes sent, step time vs DDP and FSDP2
    bench checkpoint ... save time by size; time to finish with failures vs the interval
    bench scaling ...    parameter server (1 and S servers) vs ring, emulated link; model to 4096
    bench hpsearch ...   random, SH, ASHA, Hyperband, Optuna: accuracy, epochs, busy; speed-up
    bench staging ...    a transfer staged through host memory vs direct; GPUDirect's model
    bench attention ...  ring attention, Ulysses, TP: balance, link, overlap, memory
    bench moe ...        experts: load, capacity and stragglers, all-to-all, EP vs TP
    bench cluster ...    cluster start time: engines forked from a warm template vs fresh
    faults [--repeat K] [--only A,B] [--list]
                         every promise tried: faults injected, deadlines, leftovers, exposure
    cluster clean [--all] stop clusters left behind by a killed notebook kernel
    cluster stacks       where every rank of every live cluster is: its stack, what it waits for
    labs build | check   regenerate the student labs / list the stale ones
    class assignments --root D [--labs 01 05] [--exchange E] [--generate]
                         the labs as an nbgrader course: source/labNN/, nbgrader_config.py
    class report --root D  per student: autograded scores, and what needs a GPU or two hosts
    images               regenerate the figures in images/
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def _modules(package):
    """The modules of a subpackage of course_lib (bench, figures), by name, imported."""
    import pkgutil
    from importlib import import_module
    pkg = import_module(f"course_lib.{package}")
    return {m.name: import_module(f"course_lib.{package}.{m.name}")
            for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")}


def _benchmarks():
    """Every module of course_lib/bench/ with ``HELP``, ``arguments`` and ``main``."""
    return {name: m for name, m in _modules("bench").items()
            if all(hasattr(m, attr) for attr in ("HELP", "arguments", "main"))}


def _bench_parsers(sub):
    bench = sub.add_parser("bench", help="benchmarks, measured side by side with native")
    kinds = bench.add_subparsers(dest="benchmark", required=True)
    for name, module in _benchmarks().items():
        module.arguments(kinds.add_parser(name, help=module.HELP))


def _bench(args):
    return _benchmarks()[args.benchmark].main(args)


def _images(out_dir):
    """Every module of course_lib/figures/ draws its figures with ``save_all(out_dir)``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for module in _modules("figures").values():
        module.save_all(out_dir)
    print(f"figures written to {out_dir}/")
    return 0


def _labs(action):
    from course_lib.runtime import labs
    if action == "build":
        for path in labs.build_all():
            print(f"wrote {path}")
        return 0
    stale = labs.stale()
    for path in stale:
        print(f"stale: {path} (run: python -m course_lib labs build)")
    return 1 if stale else 0


def _class(args):
    from course_lib.classroom import grading
    if args.action == "assignments":
        written = grading.write_course(args.root, labs=args.labs, exchange=args.exchange)
        for path in written:
            print(f"wrote {path}")
        if args.generate:
            for path in written:
                grading.run_nbgrader(["generate_assignment", path.parent.name, "--force"],
                                     cwd=args.root)
                print(f"generated {args.root / 'release' / path.parent.name}")
        print(f"exchange: {grading.exchange_root(args.exchange)} (nbgrader_config.py)")
        return 0
    report = grading.grading_report(args.root)
    for student, labs in sorted(report["students"].items()):
        for lab, result in sorted(labs.items()):
            if not result["submitted"]:
                print(f"{student:>16} {lab}: not submitted")
                continue
            tier1 = result["tier1"]
            print(f"{student:>16} {lab}: {tier1['score']:g}/{tier1['max_score']:g} autograded"
                  f", {len(result['tier2'])} criteria not gradable here")
    print(f"report: {report['path']}")
    return 0


def _clean(everything):
    from course_lib.runtime.launch import clean_clusters
    stopped = clean_clusters(all=everything)
    print(f"stopped {len(stopped)} cluster(s){': ' + ', '.join(stopped) if stopped else ''}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the headless tour")
    demo.add_argument("-n", type=int, default=4, help="engines (default 4)")
    demo.add_argument("--out", default="demo_output", help="folder for the figures")
    sub.add_parser("doctor", help="check this machine")
    gpu_check = sub.add_parser("gpu-check", help="the GPU path measured and checked on a GPU")
    gpu_check.add_argument("--out", type=Path, default=Path("gpu-check"))
    gpu_check.add_argument("--small", action="store_true", help="CPU-sized, to try the code")
    gpu_check.add_argument("--no-clusters", action="store_true")
    _bench_parsers(sub)
    from course_lib.testing import fault_suite
    fault_suite.arguments(sub.add_parser("faults", help="the fault suite: every promise tried"))
    cluster = sub.add_parser("cluster", help="cluster housekeeping")
    cluster.add_argument("action", choices=["clean", "stacks"])
    cluster.add_argument("--all", action="store_true", help="also clusters of live kernels")
    labs = sub.add_parser("labs", help="student labs")
    labs.add_argument("action", choices=["build", "check"])
    course = sub.add_parser("class", help="teach with the labs: nbgrader assignments, reports")
    course.add_argument("action", choices=["assignments", "report"])
    course.add_argument("--root", type=Path, required=True, help="the nbgrader course directory")
    course.add_argument("--labs", nargs="+", help="lab numbers (default: every lab)")
    course.add_argument("--exchange", help="nbgrader exchange directory (default: "
                        "$COURSE_LIB_NBGRADER_EXCHANGE, else /srv/nbgrader/exchange)")
    course.add_argument("--generate", action="store_true",
                        help="also run nbgrader generate_assignment (release/labNN/)")
    images = sub.add_parser("images", help="regenerate images/")
    images.add_argument("--out", type=Path, default=ROOT / "images")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from course_lib.runtime import demo as demo_mod
        return demo_mod.main(n=args.n, out_dir=args.out)
    if args.command == "doctor":
        from course_lib.runtime import doctor
        return doctor.main()
    if args.command == "gpu-check":
        from course_lib.testing import gpu
        return gpu.main(args.out, small=args.small, clusters=not args.no_clusters)
    if args.command == "bench":
        return _bench(args)
    if args.command == "faults":
        return fault_suite.main(args)
    if args.command == "cluster":
        if args.action == "stacks":
            from course_lib.runtime import stacks
            return stacks.main()
        return _clean(args.all)
    if args.command == "labs":
        return _labs(args.action)
    if args.command == "class":
        return _class(args)
    return _images(args.out)


if __name__ == "__main__":
    sys.exit(main())
