//! A client's bytes through the HTTP/1 head scan and hyper's server: every request hyper
//! hands on is one the scan saw with the same method, target, version, header set and
//! body framing, or it is refused. The first byte chooses how the bytes are cut into reads.
#![no_main]

use fencegate::fuzzing::{check_head_run, head_scan, pieces};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, bytes)) = data.split_first() else {
        return;
    };
    // HTTP/2's preface goes to hyper's HTTP/2 server, which the scan does not follow.
    if bytes.starts_with(b"PRI ") {
        return;
    }
    let step = usize::from(cut % 32);
    let splits: Vec<usize> = if step == 0 {
        Vec::new()
    } else {
        (1..bytes.len() / step + 1).map(|i| i * step).collect()
    };
    let run = head_scan(&pieces(bytes, &splits));
    if let Err(e) = check_head_run(&run) {
        panic!("{e}\nbytes: {:?}", String::from_utf8_lossy(bytes));
    }
});
