//! The cluster (SPEC §10) against a real 3-member etcd on loopback: its parts in one
//! process (ownership, registry, marks, owned shards, membership) and real fencegate
//! processes in front of nginx or the test double (`serve`, `lockset`, `handoff`, and
//! the fault tests).

mod faults;
mod handoff;
mod lockset;
mod marks;
mod member;
mod owned;
mod ownership;
mod procs;
mod registry;
mod serve;
mod streamed;
