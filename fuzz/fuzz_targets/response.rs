//! An upstream's bytes through the lean exchange's response decoder and hyper's client:
//! where both take the response, they read the same status, headers and body; the
//! decoder never takes one hyper's client refuses. The first byte: bit 0 a HEAD request,
//! the rest how the bytes are cut into reads.
#![no_main]

use fencegate::fuzzing::{pieces, response_hypers, response_ours};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, wire)) = data.split_first() else {
        return;
    };
    let head_request = flags & 1 == 1;
    let step = usize::from(flags >> 1) % 64;
    let splits: Vec<usize> = if step == 0 {
        Vec::new()
    } else {
        (1..wire.len() / step + 1).map(|i| i * step).collect()
    };
    let pieces = pieces(wire, &splits);
    let ours = response_ours(&pieces, head_request);
    let theirs = response_hypers(&pieces, head_request);
    match (&ours, &theirs) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "wire {:?}", String::from_utf8_lossy(wire)),
        (Ok(a), Err(e)) => panic!(
            "took {a:?} where hyper's client refused ({e}): {:?}",
            String::from_utf8_lossy(wire)
        ),
        // Stricter on purpose where it refuses what hyper takes (see decode.rs).
        (Err(_), _) => {}
    }
});
