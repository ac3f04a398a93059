//! Renewing and releasing a grant on etcd: only the exact lease (its id's secret part
//! included) and token do either; anything else is `lost`.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use tokio::time::Instant;

use super::{Etcd, Holding, delay_key, lease_not_found, lock_key, token_of, unavailable};
use crate::authority::Outcome;
use crate::token::Token;

/// A lease id as clients see it: etcd's lease (hex), a `.`, and 128 random bits (hex).
fn parse_lease_id(id: &str) -> Option<(i64, &str)> {
    let (lease, secret) = id.split_once('.')?;
    let lease = i64::from_str_radix(lease, 16).ok()?;
    (secret.len() == 32 && secret.bytes().all(|b| b.is_ascii_hexdigit())).then_some((lease, secret))
}

/// Whether `secret` (from a client's lease id) is the one `holding` was granted with,
/// compared in constant time (no early exit tells how much of it matched).
fn secret_matches(holding: &Holding, secret: &str) -> bool {
    let (given, kept) = (secret.as_bytes(), holding.secret.as_bytes());
    given.len() == kept.len()
        && !kept.is_empty()
        && given
            .iter()
            .zip(kept)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

impl Etcd {
    /// Keeps one lease alive once; answers its new ttl (None: expired or unknown).
    async fn keep_alive_once(&self, lease: i64) -> Result<Option<Duration>, etcd_client::Error> {
        // Keeping alive twice is keeping alive: the whole exchange may go to the next member.
        self.members
            .call(|mut c| async move {
                let (mut keeper, mut stream) = c.lease_keep_alive(lease).await?;
                keeper.keep_alive().await?;
                Ok(match stream.message().await? {
                    Some(r) if r.ttl() > 0 => u64::try_from(r.ttl()).ok().map(Duration::from_secs),
                    _ => None,
                })
            })
            .await
    }

    /// The lock key, if it belongs to exactly (lease, token): its holding.
    async fn current(
        &self,
        scope: &str,
        lease: i64,
        token: Token,
    ) -> Result<Option<Holding>, etcd_client::Error> {
        let key = lock_key(scope);
        let resp = self
            .members
            .call(|mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await?;
        Ok(resp.kvs().first().and_then(|kv| {
            let holding = serde_json::from_slice::<Holding>(kv.value()).ok()?;
            (kv.lease() == lease && token_of(holding.epoch, kv.create_revision()) == Some(token))
                .then_some(holding)
        }))
    }

    /// Extends the exact lease (of `holder`, when given); anything else is `lost`.
    pub async fn renew(
        &self,
        scope: &str,
        lease_id: &str,
        token: Token,
        ttl: Duration,
        holder: Option<&str>,
    ) -> Outcome {
        let Some((lease, secret)) = parse_lease_id(lease_id) else {
            return Outcome::Lost;
        };
        let outcome = self
            .renew_lease(scope, lease, secret, token, ttl, holder)
            .await;
        match &outcome {
            Outcome::Renewed { ttl } => {
                if let Some(t) = self.tracked().get_mut(&lease) {
                    t.deadline = Instant::now() + *ttl;
                }
            }
            Outcome::Lost => self.lost(lease).await,
            _ => {}
        }
        outcome
    }

    async fn renew_lease(
        &self,
        scope: &str,
        lease: i64,
        secret: &str,
        token: Token,
        ttl: Duration,
        holder: Option<&str>,
    ) -> Outcome {
        // Only the exact (lease_id, token) renews: a request naming the lease with another
        // token or scope must not keep the lease alive, so the key is looked at first.
        // The holder is part of the key's value, written once with it: (lease, token)
        // name one holding, whose holder cannot change.
        let holding = match self.current(scope, lease, token).await {
            Ok(Some(holding))
                if holder.is_none_or(|h| h == holding.holder)
                    && secret_matches(&holding, secret) =>
            {
                holding
            }
            Ok(_) => return Outcome::Lost,
            Err(e) => return unavailable(e),
        };
        // The lock_delay lease first: were the lock's lease extended and the delay's
        // keep-alive then to fail, the lock could outlive its delay, and the scope be
        // granted again with less than `lock_delay` after the holder's last renewal (or
        // stay held by a holder told it lost). Extending the delay alone only postpones
        // the next grant.
        if holding.delay_lease != 0 {
            match self.keep_alive_once(holding.delay_lease).await {
                Ok(Some(_)) => {}
                // The delay lease outlives the lock lease; losing it first means
                // something else revoked it: do not extend a lock without its delay.
                Ok(None) => return Outcome::Lost,
                Err(e) if lease_not_found(&e) => return Outcome::Lost,
                Err(e) => return unavailable(e),
            }
        }
        // Then keep the lock's lease alive, and look again: if the key is still ours after
        // a successful keep-alive, the lease was live and the key with it.
        let granted = match self.keep_alive_once(lease).await {
            Ok(Some(granted)) => granted,
            Ok(None) => return Outcome::Lost,
            Err(e) if lease_not_found(&e) => return Outcome::Lost,
            Err(e) => return unavailable(e),
        };
        match self.current(scope, lease, token).await {
            Ok(Some(_)) => Outcome::Renewed {
                ttl: ttl.min(granted),
            },
            Ok(None) => Outcome::Lost,
            Err(e) => unavailable(e),
        }
    }

    /// Ends the exact lease (of `holder`, when given); anything else is `lost`.
    pub async fn release(
        &self,
        scope: &str,
        lease_id: &str,
        token: Token,
        holder: Option<&str>,
    ) -> Outcome {
        let Some((lease, secret)) = parse_lease_id(lease_id) else {
            return Outcome::Lost;
        };
        let outcome = self
            .release_lease(scope, lease, secret, token, holder)
            .await;
        match &outcome {
            Outcome::Released => {
                let t = self.tracked().remove(&lease);
                if let Some(t) = t {
                    self.metrics.ended_by_release(t.granted.elapsed());
                }
            }
            Outcome::Lost => self.lost(lease).await,
            _ => {}
        }
        outcome
    }

    async fn release_lease(
        &self,
        scope: &str,
        lease: i64,
        secret: &str,
        token: Token,
        holder: Option<&str>,
    ) -> Outcome {
        let Ok(revision) = i64::try_from(token.counter) else {
            return Outcome::Lost;
        };
        let holding = match self.current(scope, lease, token).await {
            Ok(Some(h))
                if holder.is_none_or(|name| name == h.holder) && secret_matches(&h, secret) =>
            {
                h
            }
            Ok(_) => return Outcome::Lost,
            Err(e) => return unavailable(e),
        };
        let key = lock_key(scope);
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.as_str(), CompareOp::Equal, revision),
                Compare::lease(key.as_str(), CompareOp::Equal, lease),
            ])
            .and_then([
                TxnOp::delete(key.as_str(), None),
                TxnOp::delete(delay_key(scope), None),
            ]);
        let deleted = self
            .members
            .call(|mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await;
        match deleted {
            Ok(r) if r.succeeded() => {
                self.revoke(&[lease, holding.delay_lease]).await;
                Outcome::Released
            }
            Ok(_) => Outcome::Lost,
            Err(e) => unavailable(e),
        }
    }
}
