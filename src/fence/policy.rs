//! The decision table of SPEC §3 as a pure function, so it can be tested against a model
//! without disks or clocks.

use crate::token::Token;

/// A route's `equal` option: is a token equal to the scope's mark accepted (a retry of the
/// same generation) or stale?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EqualPolicy {
    Accept,
    Reject,
}

impl EqualPolicy {
    /// The option as written (`"accept"` when absent); `None` for anything else.
    pub fn from_option(raw: Option<&str>) -> Option<EqualPolicy> {
        match raw {
            None | Some("accept") => Some(EqualPolicy::Accept),
            Some("reject") => Some(EqualPolicy::Reject),
            Some(_) => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// No mark yet, or the token is higher: store it durably, then forward.
    Advance,
    /// Same token as the mark, and the route accepts equal tokens: forward.
    Accept,
    /// A newer generation reached this scope (or `equal = "reject"`): 409, forever.
    Stale,
}

/// `floor` is the epoch floor (PUT /v1/floor): every token of a lower epoch is stale.
pub fn decide(mark: Option<Token>, token: Token, equal: EqualPolicy, floor: u64) -> Decision {
    if token.epoch < floor {
        return Decision::Stale;
    }
    match mark {
        None => Decision::Advance,
        Some(m) if token > m => Decision::Advance,
        Some(m) if token == m && equal == EqualPolicy::Accept => Decision::Accept,
        Some(_) => Decision::Stale,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn table() {
        let t = Token::new(0, 42);
        let acc = EqualPolicy::Accept;
        let rej = EqualPolicy::Reject;
        assert_eq!(decide(None, t, acc, 0), Decision::Advance);
        assert_eq!(
            decide(Some(Token::new(0, 41)), t, acc, 0),
            Decision::Advance
        );
        assert_eq!(decide(Some(t), t, acc, 0), Decision::Accept);
        assert_eq!(decide(Some(t), t, rej, 0), Decision::Stale);
        assert_eq!(decide(Some(Token::new(0, 43)), t, acc, 0), Decision::Stale);
        assert_eq!(
            decide(Some(Token::new(0, 999)), Token::new(1, 0), acc, 0),
            Decision::Advance
        );
        assert_eq!(decide(None, t, acc, 1), Decision::Stale);
    }

    proptest! {
        /// The model: a scope is a number line; a request is admitted iff it does not go back.
        #[test]
        fn matches_model(mark in proptest::option::of((0u64..3, 0u64..5)), tok in (0u64..3, 0u64..5), reject: bool, floor in 0u64..3) {
            let equal = if reject { EqualPolicy::Reject } else { EqualPolicy::Accept };
            let d = decide(mark.map(|(e, c)| Token::new(e, c)), Token::new(tok.0, tok.1), equal, floor);
            let model = if tok.0 < floor {
                Decision::Stale
            } else {
                match mark {
                    None => Decision::Advance,
                    Some(m) if tok > m => Decision::Advance,
                    Some(m) if tok == m && !reject => Decision::Accept,
                    _ => Decision::Stale,
                }
            };
            prop_assert_eq!(d, model);
        }
    }
}
