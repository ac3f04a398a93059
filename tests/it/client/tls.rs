//! The Rust client over https: the proxy's `[server] tls` listener with a private CA and a
//! required client certificate. Certificates are made here with rcgen, on loopback.

use crate::support;

use std::path::Path;
use std::time::Duration;

use fencegate::client::{ClientOptions, ClientTls, Fence, FenceResult, FencedHttp};
use fencegate::settings::Config;
use fencegate::token::Token;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use support::{Double, config_text};

struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        Ca {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    /// Writes `NAME.pem` and `NAME.key` of a new leaf into `dir`.
    fn leaf(&self, dir: &Path, name: &str, dns: &str, usage: ExtendedKeyUsagePurpose) {
        let mut params = CertificateParams::new(vec![dns.to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        crate::support::write_secret(dir.join(format!("{name}.key")), key.serialize_pem());
    }
}

/// A private CA (`ca.pem`) and, signed by it, `server.pem`/`.key` for localhost and
/// `client.pem`/`.key` for client authentication, written into `d`.
fn write_pki(d: &Path) {
    let ca = Ca::new("test ca");
    ca.leaf(
        d,
        "server",
        "localhost",
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    ca.leaf(
        d,
        "client",
        "client.test",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    std::fs::write(d.join("ca.pem"), ca.issuer.pem()).unwrap();
}

#[tokio::test]
async fn fenced_requests_go_over_https_with_a_private_ca_and_a_client_certificate() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_pki(d);
    let anchor = "trusted_proxies = [\"127.0.0.1\"]\n";
    let text = config_text(double.addr, "10s", "0s", "10s").replace(
        anchor,
        &format!(
            "{anchor}tls = {{ cert = \"server.pem\", key = \"server.key\", client_ca = \"ca.pem\" }}\n"
        ),
    );
    let running = support::start(Config::parse(&text, d).expect("config")).await;
    let base = format!("https://localhost:{}", running.proxy_addr.port());
    let fence = Fence::new("report/july", Token::new(0, 1));
    let with = |tls: Option<ClientTls>| {
        FencedHttp::with_options(
            &base,
            ClientOptions {
                tls,
                ..ClientOptions::default()
            },
        )
        .unwrap()
    };

    // The private CA and the client certificate: through the fence.
    let tls = ClientTls::new(
        Some(&d.join("ca.pem")),
        Some((&d.join("client.pem"), &d.join("client.key"))),
    )
    .expect("client tls");
    let r = with(Some(tls)).put(&fence, "/reports/july/a", "x").await;
    assert!(matches!(r, Ok(FenceResult::Applied { .. })), "{r:?}");
    assert_eq!(double.seen().len(), 1);

    // Without the client certificate, or trusting only the built-in roots: no request.
    let no_identity = ClientTls::new(Some(&d.join("ca.pem")), None).expect("tls");
    for http in [with(Some(no_identity)), with(None)] {
        let r = http.put(&fence, "/reports/july/b", "x").await;
        assert!(
            matches!(
                r,
                Ok(FenceResult::Transient { .. } | FenceResult::Unknown { .. })
            ),
            "{r:?}"
        );
    }
    assert_eq!(double.seen().len(), 1, "nothing else reached the upstream");

    // Files that are not what they should be are refused with their name.
    let e = ClientTls::new(Some(&d.join("server.key")), None).unwrap_err();
    assert!(e.to_string().contains("server.key"), "{e}");
    let e = ClientTls::new(
        Some(&d.join("ca.pem")),
        Some((&d.join("client.pem"), &d.join("server.key"))),
    )
    .unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
    running.shutdown().await;
}

/// The whole client over https: a lease from the authority's own TLS listener (private CA,
/// client certificate, bearer secret), and its token and proof through the proxy's TLS
/// listener to a `proof = "required"` route.
#[tokio::test]
async fn a_lease_is_taken_over_https_and_its_proof_travels_through_the_fence() {
    use fencegate::client::{AuthorityClient, Secret};
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_pki(d);
    crate::support::write_secret(d.join("w.token"), "w-secret\n");
    fencegate::proof::keygen(&d.join("fence")).unwrap();
    let tls = "tls = { cert = \"server.pem\", key = \"server.key\", client_ca = \"ca.pem\" }\n";
    let anchor = "trusted_proxies = [\"127.0.0.1\"]\n";
    let text = config_text(double.addr, "10s", "0s", "10s")
        .replace(anchor, &format!("{anchor}{tls}"))
        .replace("[fencing]\n", "[fencing]\nproof_keys = [\"fence.pub\"]\n")
        .replace(
            "scope = \"report/{report}\"\nupstream = \"u\"\n",
            "scope = \"report/{report}\"\nupstream = \"u\"\nproof = \"required\"\n",
        )
        + &format!(
            "\n[authority]\nlisten = \"127.0.0.1:0\"\nsigning_key = \"fence.key\"\n{tls}\
             [[authority.client]]\nname = \"writer\"\ntoken_file = \"w.token\"\nscopes = [\"report/*\"]\n"
        );
    let running = support::start(Config::parse(&text, d).expect("config")).await;
    let options = || ClientOptions {
        tls: Some(
            ClientTls::new(
                Some(&d.join("ca.pem")),
                Some((&d.join("client.pem"), &d.join("client.key"))),
            )
            .expect("client tls"),
        ),
        bearer: Some(Secret("w-secret".into())),
        ..ClientOptions::default()
    };
    let port = running.authority_addr.expect("authority").port();
    let authority =
        AuthorityClient::with_options(&format!("https://localhost:{port}"), options()).unwrap();
    let lease = authority
        .acquire("report/july", "", Duration::from_secs(10), Duration::ZERO)
        .await
        .expect("a lease over https");
    assert!(lease.proof().is_some_and(|p| p.starts_with("v1.")));
    let proxy = FencedHttp::with_options(
        &format!("https://localhost:{}", running.proxy_addr.port()),
        options(),
    )
    .unwrap();
    let r = proxy
        .put(&lease.fence().unwrap(), "/reports/july/a", "x")
        .await;
    assert!(matches!(r, Ok(FenceResult::Applied { .. })), "{r:?}");
    // The same token without its proof is refused at the fence.
    let bare = Fence::new("report/july", lease.token());
    let r = proxy.put(&bare, "/reports/july/b", "y").await;
    assert!(!matches!(r, Ok(FenceResult::Applied { .. })), "{r:?}");
    assert_eq!(
        double.seen().len(),
        1,
        "only the proven request reached the upstream"
    );

    // Plain HTTP to the authority's TLS port gets nothing.
    let plain = AuthorityClient::new(&format!("http://127.0.0.1:{port}")).unwrap();
    assert!(
        plain
            .acquire("report/july", "x", Duration::from_secs(1), Duration::ZERO)
            .await
            .is_err()
    );
    running.shutdown().await;
}
