//! The fence: its `[fencing]` section (config), the decision table (policy), the durable marks (marks) and the per-scope
//! generation gate (gate) that orders generations at the backend.

pub mod config;
pub mod gate;
pub mod journal;
pub mod marks;
pub mod policy;

pub use gate::{Admission, Gates, InflightGuard, Proof, Refusal};
pub use marks::{MarkStore, Snapshot, StoreError};
pub use policy::{Decision, EqualPolicy, decide};
