//! How a configuration section is read (SPEC §5): the error accumulator ([`error`]), which
//! keeps every error with its key path so `check-config` shows an operator all of them at
//! once, and the value checks (`value`: durations, sizes, addresses, bounded and private
//! files). A leaf: it imports nothing of the crate, so every subsystem's section reader
//! and the assembler ([`crate::settings`]) can use it without an import cycle.

pub mod error;
pub(crate) mod value;

pub use error::{ConfigError, ConfigErrors};
pub use value::parse_size;
