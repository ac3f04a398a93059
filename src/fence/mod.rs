//! The fence: its `[fencing]` section ([`config`]), the decision table ([`policy`]) and
//! the per-scope generation gate ([`gate`]) that orders generations at the backend. The
//! durable marks it decides against are the [`crate::store`]'s, or in a cluster a
//! [`source::MarkSource`]'s.

pub mod config;
pub mod gate;
pub mod policy;
pub mod source;

pub use gate::{Admission, Gates, InflightGuard, Proof, Refusal, TreeHold};
pub use policy::{Decision, EqualPolicy, decide};
pub use source::MarkSource;
