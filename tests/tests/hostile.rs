//! Hostile bytes on a node's listen port must not disturb a generation running through it, nor kill the node.
use petal_tests::*;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

const PROMPT: &str = "Once upon a time";

/// What one attacker connection sends.
#[derive(Clone, Copy, Debug)]
enum Attack {
    /// Random bytes, as fast as the node takes them; reconnects whenever the node hangs up.
    RandomBytes,
    /// A 4-byte big-endian length prefix claiming 1 GiB, then a trickle of bytes, holding the connection open.
    HugeLengthPrefix,
    /// A valid multistream-select header proposing /noise, then a noise frame claiming 65535 bytes of junk.
    BogusNoiseHandshake,
    /// Connects and says nothing.
    Idle,
}

fn attacker(
    addr: SocketAddr,
    attack: Attack,
    seed: u64,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut rng = XorShift::new(seed);
        let mut buf = vec![0u8; 16 * 1024];
        while !stop.load(Ordering::Relaxed) {
            let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
                thread::sleep(Duration::from_millis(50));
                continue;
            };
            let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
            let first: Vec<u8> = match attack {
                Attack::RandomBytes | Attack::Idle => vec![],
                Attack::HugeLengthPrefix => (1u32 << 30).to_be_bytes().to_vec(),
                Attack::BogusNoiseHandshake => {
                    let mut v = b"\x13/multistream/1.0.0\n\x07/noise\n".to_vec();
                    v.extend_from_slice(&[0xff, 0xff]);
                    v
                }
            };
            connections.fetch_add(1, Ordering::Relaxed);
            if s.write_all(&first).is_err() {
                continue;
            }
            // Keep this connection busy until the node closes it or the test stops us.
            while !stop.load(Ordering::Relaxed) {
                let n = match attack {
                    Attack::RandomBytes => buf.len(),
                    Attack::HugeLengthPrefix | Attack::BogusNoiseHandshake => 64,
                    Attack::Idle => 0,
                };
                rng.fill(&mut buf[..n]);
                match s.write(&buf[..n]) {
                    Ok(0) if n > 0 => break,
                    Ok(w) => {
                        sent.fetch_add(w, Ordering::Relaxed);
                    }
                    Err(e)
                        if e.kind() == std::io::ErrorKind::WouldBlock
                            || e.kind() == std::io::ErrorKind::TimedOut => {}
                    Err(_) => break,
                }
                // Fast enough to make the node handle many bad connections, slow enough not to starve
                // the generation of CPU on a two-core machine.
                thread::sleep(Duration::from_millis(match attack {
                    Attack::RandomBytes => 5,
                    _ => 100,
                }));
            }
        }
    })
}

#[test]
fn random_bytes_do_not_disturb_generation() {
    let model = stories_bin();
    let mut swarm = Swarm::builder()
        .node(&model, "0..3")
        .node(&model, "3..5")
        .start();
    let n_tokens = 256;
    let local = Generate::new(&model, PROMPT)
        .local()
        .max_new_tokens(n_tokens)
        .ignore_eos()
        .run_json();

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let connections = Arc::new(AtomicUsize::new(0));
    let mut attackers = vec![];
    let mut seed = 1;
    for node in &swarm.nodes {
        let addr: SocketAddr = ([127, 0, 0, 1], node.tcp_port()).into();
        let attacks = [
            Attack::RandomBytes,
            Attack::RandomBytes,
            Attack::HugeLengthPrefix,
            Attack::BogusNoiseHandshake,
            Attack::Idle,
            Attack::Idle,
            Attack::Idle,
            Attack::Idle,
        ];
        for attack in attacks {
            seed += 1;
            attackers.push(attacker(
                addr,
                attack,
                seed,
                stop.clone(),
                sent.clone(),
                connections.clone(),
            ));
        }
    }
    // Let the attack get going, then generate through both attacked nodes while it goes on.
    thread::sleep(Duration::from_millis(500));
    let during = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(n_tokens)
        .ignore_eos()
        .run_json();
    thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        a.join().expect("attacker thread panicked");
    }
    eprintln!(
        "{} hostile connections sent {} bytes; generation during the attack: {:.1} tokens/s over {:?}",
        connections.load(Ordering::Relaxed),
        sent.load(Ordering::Relaxed),
        during.tokens_per_second,
        during.route
    );
    assert!(sent.load(Ordering::Relaxed) > 0, "the attack sent nothing");
    assert_same_tokens("generation under attack", &during, &local);

    for node in &mut swarm.nodes {
        assert!(
            node.proc.is_alive(),
            "{} died under hostile input\n{}",
            node.spec.name,
            node.proc.report()
        );
        let log = node.proc.stderr_log();
        assert!(
            !log.contains("panicked"),
            "{} panicked\n{log}",
            node.spec.name
        );
    }
    // And the swarm still works afterwards.
    let after = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(32)
        .ignore_eos()
        .run_json();
    assert_eq!(after.tokens[..], local.tokens[..32]);
    let peers = swarm.listed_peers();
    for node in &swarm.nodes {
        assert!(
            peers.contains(&node.peer_id),
            "{} no longer listed",
            node.spec.name
        );
    }
}
