//! Bad `petal-node serve` input fails at once with a clear `error:` line, never a panic or a hang.
use petal_tests::*;
use std::process::Command;
use std::time::Duration;

/// Runs `petal-node serve ARGS --listen 127.0.0.1` and checks it fails quickly with an error naming `expect`.
fn serve_fails(args: &[&str], expect: &[&str]) {
    let mut cmd = Command::new(bin("petal-node"));
    cmd.arg("serve").args(args).args(["--listen", LISTEN]);
    let out = run_with_timeout(cmd, Duration::from_secs(30));
    eprintln!("{out}\n");
    assert!(!out.timed_out(), "serve with bad input did not exit\n{out}");
    assert!(
        !out.success(),
        "serve with bad input exited successfully\n{out}"
    );
    assert!(
        out.elapsed < Duration::from_secs(15),
        "took {:?} to reject bad input\n{out}",
        out.elapsed
    );
    assert!(!out.stderr.contains("panicked"), "panicked\n{out}");
    assert!(
        !out.stdout.contains("serving blocks"),
        "claimed to serve\n{out}"
    );
    let error = out
        .stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no `error:` line on stderr\n{out}"));
    for e in expect {
        assert!(
            error.contains(e),
            "the error should mention {e:?}: {error:?}"
        );
    }
}

#[test]
fn bad_startup_is_a_clear_error() {
    let gguf = smollm_gguf();
    let gguf = gguf.to_str().unwrap();
    serve_fails(&["--model", gguf, "--blocks", "10..40"], &["30 blocks"]);
    serve_fails(&["--model", gguf, "--blocks", "3..3"], &["empty"]);
    let missing = smollm_gguf().with_file_name("no-such-model.gguf");
    let missing = missing.to_str().unwrap();
    serve_fails(&["--model", missing, "--blocks", "0..2"], &[missing]);
    serve_fails(
        &["--model", gguf, "--blocks", "0..2", "--device", "cuda:0"],
        &["cuda:0", "available"],
    );
}

/// The side-by-side bench refuses a device this build or machine lacks before it loads or measures anything.
#[test]
fn bench_compare_refuses_an_absent_device() {
    let mut cmd = Command::new(bin("petal-bench"));
    cmd.args(["compare", "--device", "cuda:7", "--model"])
        .arg(smollm_gguf());
    let out = run_with_timeout(cmd, Duration::from_secs(30));
    assert!(!out.success() && !out.timed_out(), "{out}");
    assert!(!out.stderr.contains("panicked"), "panicked\n{out}");
    assert!(
        out.stderr.contains("cuda:7") && out.stderr.contains("available"),
        "the error should name the device and what is available\n{out}"
    );
    assert!(out.stdout.trim().is_empty(), "printed a report\n{out}");
}

/// The fixture itself: a node that cannot start fails the test at once, with the node's error in the message,
/// instead of waiting out the startup timeout.
#[test]
#[should_panic(expected = "the model has 30 blocks")]
fn swarm_fixture_reports_a_node_that_fails_to_start() {
    let _swarm = Swarm::builder().node(smollm_gguf(), "25..31").start();
}

#[test]
fn negative_durations_are_refused_by_every_binary() {
    let cases: [(&str, &[&str]); 3] = [
        ("petal", &["swarm", "--bootstrap", LISTEN, "--timeout=-1"]),
        ("petal-node", &["bootstrap", "--record-ttl=-5"]),
        (
            "petal-node",
            &[
                "serve",
                "--model",
                "m",
                "--blocks",
                "0..1",
                "--drain-timeout=NaN",
            ],
        ),
    ];
    for (binary, args) in cases {
        let mut cmd = Command::new(bin(binary));
        cmd.args(args);
        let out = run_with_timeout(cmd, Duration::from_secs(30));
        eprintln!("{binary} {args:?}\n{out}\n");
        assert!(!out.success() && !out.timed_out(), "{out}");
        assert!(!out.stderr.contains("panicked"), "panicked\n{out}");
        assert!(
            out.stderr.contains("non-negative number of seconds"),
            "names the problem\n{out}"
        );
    }
}
