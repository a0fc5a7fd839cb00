//! The floor of the chain row: the same spans decoding through a chain with none of Petal's networking, against
//! local decoding with no hand-off at all, so a report shows how much of the chain's gap is this machine's.
//!
//! Each node is a thread with its own span, cache and rayon pool, its loop running on one of that pool's threads
//! (a forward starts where the input was read: one thread woken per leg), joined to the next by a blocking
//! loopback TCP socket with `TCP_NODELAY`; the client's thread embeds, sends, reads the last node's output and
//! samples greedily. Local decodes every block on one thread inside one pool. No libp2p, no tokio, no scheduler:
//! what is left per token is four socket legs and the wake-ups they cause. Measured on a 2-vCPU KVM guest this
//! reached 0.72-1.05x local (median 0.93) where Petal's chain reached 0.76-0.81x.
use anyhow::{anyhow, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use petal_model::text::greedy::argmax;
use petal_model::{BlockRange, BlockSpan, Head, ModelSource, Placement};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Every run's tokens per second (over `steps` greedy steps after `prompt`), local's and the chain's, alternated.
pub struct Floor {
    pub local: Vec<f64>,
    pub chain: Vec<f64>,
}

/// The spans' hidden states on the wire: position, element count, little-endian f32s.
fn send(s: &mut TcpStream, position: usize, x: &Tensor) -> Result<()> {
    let v: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let mut frame = Vec::with_capacity(8 + 4 * v.len());
    frame.extend_from_slice(&u32::try_from(position)?.to_le_bytes());
    frame.extend_from_slice(&u32::try_from(v.len())?.to_le_bytes());
    v.iter()
        .for_each(|f| frame.extend_from_slice(&f.to_le_bytes()));
    Ok(s.write_all(&frame)?)
}

/// The next frame as `(position, [1, tokens, hidden])`; `None` once the sender closed.
fn recv(s: &mut TcpStream, hidden: usize) -> Result<Option<(usize, Tensor)>> {
    let mut header = [0u8; 8];
    match s.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let [p0, p1, p2, p3, n0, n1, n2, n3] = header;
    let (position, n) = (
        u32::from_le_bytes([p0, p1, p2, p3]),
        u32::from_le_bytes([n0, n1, n2, n3]),
    );
    let n = n as usize;
    ensure!(
        hidden > 0 && n.is_multiple_of(hidden),
        "a frame of {n} values for hidden size {hidden}"
    );
    let mut bytes = vec![0u8; 4 * n];
    s.read_exact(&mut bytes)?;
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(Some((
        position as usize,
        Tensor::from_vec(v, (1, n / hidden, hidden), &Device::Cpu)?,
    )))
}

/// Both ends of a loopback TCP connection.
fn link() -> Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let a = TcpStream::connect(listener.local_addr()?)?;
    let (b, _) = listener.accept()?;
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    Ok((a, b))
}

fn pool(threads: usize) -> Result<rayon::ThreadPool> {
    Ok(rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?)
}

fn span(
    source: &ModelSource,
    range: BlockRange,
    placement: &Placement,
    kv: Option<DType>,
) -> Result<BlockSpan> {
    let mut span = source.load_span_on(range, placement)?;
    span.set_kv_dtype(kv);
    Ok(span)
}

/// Tokens per second of one run, and the tokens it sampled.
type Run = (f64, Vec<u32>);

/// Greedy decoding of `steps` tokens after `prompt`, `through` taking embeddings at a position to the last
/// block's output: the loop local and the chain's client share, timed from the first decode step.
fn greedy(
    head: &Head,
    prompt: &[u32],
    steps: usize,
    mut through: impl FnMut(&Tensor, usize) -> Result<Tensor>,
) -> Result<Run> {
    let h = through(&head.embed(prompt)?, 0)?;
    let mut tokens = vec![argmax(&head.logits(&h)?)?];
    let start = Instant::now();
    for i in 0..steps {
        let h = through(&head.embed(&tokens[i..=i])?, prompt.len() + i)?;
        tokens.push(argmax(&head.logits(&h)?)?);
    }
    Ok((steps as f64 / start.elapsed().as_secs_f64(), tokens))
}

/// [`greedy`] with every block on this thread inside `pool`.
fn local(
    head: &Head,
    full: &BlockSpan,
    pool: &rayon::ThreadPool,
    prompt: &[u32],
    steps: usize,
) -> Result<Run> {
    pool.install(|| {
        let mut cache = full.new_cache(full.range(), prompt.len() + steps)?;
        greedy(head, prompt, steps, |x, position| {
            Ok(full.forward(x, position, &mut cache)?)
        })
    })
}

/// [`greedy`] through `spans`, each a node thread as described above, taking rows of `hidden` values.
fn chain(
    head: &Head,
    spans: &[BlockSpan],
    (threads, hidden): (usize, usize),
    prompt: &[u32],
    steps: usize,
) -> Result<Run> {
    let (mut to_first, first_in) = link()?;
    let mut inputs = vec![first_in];
    let mut outputs = vec![];
    for _ in 1..spans.len() {
        let (out, next_in) = link()?;
        outputs.push(out);
        inputs.push(next_in);
    }
    let (last_out, mut from_last) = link()?;
    outputs.push(last_out);
    let client = pool(threads)?;
    std::thread::scope(|scope| {
        let nodes: Vec<_> = spans
            .iter()
            .zip(inputs.into_iter().zip(outputs))
            .map(|(span, (mut input, mut output))| {
                scope.spawn(move || -> Result<()> {
                    let own = pool(threads)?;
                    let mut cache = span.new_cache(span.range(), prompt.len() + steps)?;
                    own.install(|| {
                        while let Some((position, x)) = recv(&mut input, hidden)? {
                            send(
                                &mut output,
                                position,
                                &span.forward(&x, position, &mut cache)?,
                            )?;
                        }
                        Ok(())
                    })
                })
            })
            .collect();
        let run = client.install(|| {
            greedy(head, prompt, steps, |x, position| {
                send(&mut to_first, position, x)?;
                let (_, h) = recv(&mut from_last, hidden)?.context("the chain closed")?;
                Ok(h)
            })
        });
        // Closing the first link ends every node's loop in turn.
        drop(to_first);
        for node in nodes {
            node.join()
                .map_err(|_| anyhow!("a node thread panicked"))??;
        }
        run
    })
}

/// `repeats` runs of each, alternated, on the CPU with `threads` threads per pool. Every chain run must sample
/// the tokens local sampled: a floor that computed something else would be no floor.
pub fn measure(
    source: &ModelSource,
    kv: Option<DType>,
    spans: &[BlockRange],
    prompt: &[u32],
    steps: usize,
    repeats: usize,
    threads: usize,
) -> Result<Floor> {
    ensure!(!prompt.is_empty(), "the floor's prompt is empty");
    let placement = source.block_placement(&Device::Cpu, Some(DType::F32));
    let head = source.load_head(Placement::new(Device::Cpu, DType::F32))?;
    let all = BlockRange::new(0, source.spec().num_blocks);
    let full = span(source, all, &placement, kv)?;
    let parts = spans
        .iter()
        .map(|r| span(source, *r, &placement, kv))
        .collect::<Result<Vec<_>>>()?;
    let local_pool = pool(threads)?;
    let hidden = source.spec().hidden_size;
    let mut floor = Floor {
        local: vec![],
        chain: vec![],
    };
    for _ in 0..repeats {
        let (rate, expected) = local(&head, &full, &local_pool, prompt, steps)?;
        floor.local.push(rate);
        let (rate, got) = chain(&head, &parts, (threads, hidden), prompt, steps)?;
        ensure!(
            got == expected,
            "the floor's chain sampled {got:?}, local {expected:?}"
        );
        floor.chain.push(rate);
    }
    Ok(floor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stories() -> ModelSource {
        const STORIES: &str = "stories260K/stories260K.bin";
        let path = petal_model::models_dir::find_model(STORIES)
            .unwrap_or_else(|| panic!("{}", petal_model::models_dir::missing_model(STORIES)));
        ModelSource::open(&path).expect("stories260K")
    }

    #[test]
    fn the_floor_chain_samples_what_local_samples() {
        let source = stories();
        let spans = [
            BlockRange::new(0, 2),
            BlockRange::new(2, 3),
            BlockRange::new(3, 5),
        ];
        for kv in [None, Some(DType::F16)] {
            let floor = measure(&source, kv, &spans, &[1, 403, 407], 12, 2, 2).expect("floor");
            assert_eq!((floor.local.len(), floor.chain.len()), (2, 2));
            assert!(floor
                .local
                .iter()
                .chain(&floor.chain)
                .all(|r| r.is_finite() && *r > 0.0));
        }
    }

    #[test]
    fn frames_round_trip_and_a_closed_link_ends_the_loop() {
        let (mut a, mut b) = link().expect("link");
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
        let x = Tensor::from_vec(values.clone(), (1, 2, 6), &Device::Cpu).expect("tensor");
        send(&mut a, 7, &x).expect("send");
        let (position, y) = recv(&mut b, 6).expect("recv").expect("a frame");
        assert_eq!(position, 7);
        assert_eq!(y.dims(), &[1, 2, 6]);
        assert_eq!(
            y.flatten_all().and_then(|t| t.to_vec1::<f32>()).ok(),
            Some(values)
        );
        send(&mut a, 8, &x).expect("send");
        assert!(recv(&mut b, 5).is_err(), "12 values are not rows of 5");
        // A sender that closes between frames ends the receiver's loop cleanly.
        let (a, mut b) = link().expect("link");
        drop(a);
        assert!(recv(&mut b, 6).expect("a clean end").is_none());
    }
}
