//! Runtime plumbing that knows nothing of HTTP's meaning: the workers' coarse timers and
//! deadlines ([`timer`]) and graceful drain of connections ([`drain`]).

pub(crate) mod drain;
pub mod timer;
