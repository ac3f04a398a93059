//! A request head and body as hyper hands them on, through the upstream head's
//! preparation and the lean exchange's encoder: read back with httparse, the bytes are
//! one request with the method, target, Host, token and body that were decided on. The
//! first byte says whether the client is a trusted proxy; the head ends at its empty line.
#![no_main]

use fencegate::fuzzing::forwarded;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let Some(end) = rest.windows(4).position(|w| w == b"\r\n\r\n") else {
        return;
    };
    let (head, body) = rest.split_at(end + 4);
    if let Some(Err(e)) = forwarded(head, body, flags & 1 == 1) {
        panic!("{e}");
    }
});
