//! The shard map: which of a cluster's `shards` shards a scope belongs to. Every instance
//! must compute the same answer for the cluster's whole life, across fencegate versions,
//! so the hash is spelled out here (FNV-1a, 64 bits) rather than taken from the standard
//! library (whose `Hasher`s may change between releases, and `RandomState` is keyed at
//! random per process) or a crate whose output is not a promise.

/// FNV-1a's 64-bit offset basis and prime (Fowler, Noll, Vo).
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64 bits, of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = FNV_OFFSET;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// murmur3's 64-bit finalizer (Appleby): every input bit reaches every output bit.
pub fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

/// The shard of `scope` among `shards` (0 to shards − 1): FNV-1a of the scope's bytes,
/// mixed by murmur3's finalizer, reduced by a multiply-shift (Lemire) that keeps the high
/// bits and needs no division. FNV-1a alone leaves its high bits nearly untouched by the
/// last bytes, where scopes such as `report/r0` … `report/r15` differ (measured: those 16
/// fell into 2 of 8 shards); the finalizer spreads them. `shards` is at least 1 (config
/// checks it); 0 gives 0.
pub fn shard_of(scope: &str, shards: u32) -> u32 {
    // (h · shards) / 2^64 < shards, so the cast cannot truncate.
    ((u128::from(fmix64(fnv1a64(scope.as_bytes()))) * u128::from(shards)) >> 64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_published_test_vectors() {
        // From the FNV reference test suite (isthe.com/chongo/tech/comp/fnv).
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    /// Pinned: a change here moves scopes between shards in a running cluster.
    #[test]
    fn shard_of_is_pinned() {
        let pinned = [
            ("", 64, 59),
            ("a", 64, 32),
            ("foobar", 64, 11),
            ("report/july", 64, 60),
            ("bucket/photos/cat.jpg", 1024, 262),
        ];
        for (scope, shards, want) in pinned {
            assert_eq!(shard_of(scope, shards), want, "{scope:?} over {shards}");
        }
    }

    /// Scopes that differ only in their last characters, few of them: every shard gets
    /// its part (without the finalizer, 16 of these took 2 shards of 8).
    #[test]
    fn short_similar_scopes_spread_over_the_shards() {
        let mut counts = [0u32; 8];
        for i in 0..64 {
            counts[shard_of(&format!("report/r{i}"), 8) as usize] += 1;
        }
        assert!(counts.iter().all(|&n| (3..=14).contains(&n)), "{counts:?}");
        let mut counts = [0u32; 8];
        for i in 0..16 {
            counts[shard_of(&format!("report/r{i}"), 8) as usize] += 1;
        }
        assert!(counts.iter().filter(|&&n| n > 0).count() >= 5, "{counts:?}");
    }

    #[test]
    fn one_shard_takes_everything_and_zero_gives_zero() {
        for scope in ["", "a", "report/july"] {
            assert_eq!(shard_of(scope, 1), 0);
            assert_eq!(shard_of(scope, 0), 0);
        }
        assert!(shard_of("x", u32::MAX) < u32::MAX);
    }

    #[test]
    fn scopes_spread_evenly_over_the_shards() {
        for (shards, scopes) in [(64u32, 100_000u32), (7, 70_000), (1024, 1_000_000)] {
            let mut counts = vec![0u32; shards as usize];
            for i in 0..scopes {
                // Scopes as they come in practice: a shared prefix, a short varying tail.
                counts[shard_of(&format!("tenant/{}/object-{i}", i % 97), shards) as usize] += 1;
            }
            let mean = f64::from(scopes) / f64::from(shards);
            for (shard, &n) in counts.iter().enumerate() {
                let off = (f64::from(n) - mean).abs() / mean;
                assert!(
                    off <= 0.20,
                    "shard {shard} of {shards}: {n} scopes, mean {mean:.0}"
                );
            }
        }
    }
}
