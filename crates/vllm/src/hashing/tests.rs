//! Unit tests for block hashing. Expected digests come from CPython 3.11 (`pickle`, `hashlib`)
//! run on the same inputs; the golden file is covered by `tests/golden_hashes.rs`.

use super::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn sha256(block_size: usize) -> BlockHasher {
    BlockHasher::new(HashAlgo::Sha256, block_size, None, ExtraKeysFormat::Tagged).unwrap()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn algo_and_format_names_round_trip() {
    for algo in HashAlgo::ALL {
        assert_eq!(algo.as_str().parse::<HashAlgo>().unwrap(), algo);
        assert_eq!(algo.to_string(), algo.as_str());
    }
    assert_eq!(
        "md5".parse::<HashAlgo>(),
        Err(HashError::UnknownAlgo("md5".into()))
    );
    assert_eq!(
        "untagged".parse::<ExtraKeysFormat>().unwrap(),
        ExtraKeysFormat::Untagged
    );
    assert!("legacy".parse::<ExtraKeysFormat>().is_err());
}

#[test]
fn none_hash_per_algorithm_and_seed() {
    let cases = [
        (
            HashAlgo::Sha256,
            None,
            "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        ),
        (
            HashAlgo::Sha256Cbor,
            None,
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        ),
        (
            HashAlgo::Sha256,
            Some("0"),
            "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
        ),
        (
            HashAlgo::Xxhash,
            Some("0"),
            "6fb31cc38bba6066183f7f2104b9c051",
        ),
        (
            HashAlgo::XxhashCbor,
            Some("12345"),
            "71c23af9c69f9961f42bc1307108debb",
        ),
    ];
    for (algo, seed, want) in cases {
        let h = BlockHasher::new(algo, 16, seed, ExtraKeysFormat::Tagged).unwrap();
        assert_eq!(h.none_hash().to_hex(), want, "{algo} seed {seed:?}");
    }
}

#[test]
fn xxhash_without_seed_is_an_error() {
    for algo in [HashAlgo::Xxhash, HashAlgo::XxhashCbor] {
        let err = BlockHasher::new(algo, 16, None, ExtraKeysFormat::Tagged).unwrap_err();
        assert_eq!(err, HashError::SeedRequired(algo));
        assert_eq!(err.label(), "seed_required");
    }
    assert_eq!(
        BlockHasher::new(HashAlgo::Sha256, 0, None, ExtraKeysFormat::Tagged).unwrap_err(),
        HashError::ZeroBlockSize
    );
}

#[test]
fn partial_blocks_are_never_hashed() {
    let h = sha256(16);
    let tokens: Vec<u32> = (0..40).collect();
    let none = RequestExtras::default();
    assert_eq!(h.hash_blocks(&tokens, &none).len(), 2);
    assert!(h.hash_blocks(&tokens[..15], &none).is_empty());
    assert_eq!(
        h.hash_block(None, &tokens[..15], 0, &none),
        Err(HashError::PartialBlock {
            len: 15,
            block_size: 16
        })
    );
    assert!(h.hash_input_bytes(None, &tokens[..17], 0, &none).is_err());
    // The partial tail does not change the full blocks' digests.
    assert_eq!(
        h.hash_blocks(&tokens, &none),
        h.hash_blocks(&tokens[..32], &none)
    );
}

/// Blocks past 64 KiB of pickle: frame splits, unframed large strings, LONG1 tokens.
#[test]
fn large_blocks_match_cpython_framing() {
    let binint = |n: u32| (0..n).map(|i| 100_000 + i).collect::<Vec<u32>>();
    let none = RequestExtras::default();
    let lora = |path: String| RequestExtras {
        lora: Some(Lora {
            name: "sql-lora".into(),
            path,
        }),
        ..RequestExtras::default()
    };
    let cases: Vec<(Vec<u32>, RequestExtras, usize, &str)> = vec![
        (
            binint(13100),
            none.clone(),
            65562,
            "688c787ab3df927d424cbc7c0b9508b4f354cc886447604cdaddc80910545fe5",
        ),
        (
            binint(13101),
            none.clone(),
            65567,
            "c30ea4612e16eaff8ea7ceaeef5d641c928e7cc80000231373402b3200fb3a13",
        ),
        (
            (0..20000u32)
                .map(|i| (u64::from(i) * 2_654_435_761 % (1 << 32)) as u32)
                .collect(),
            none.clone(),
            120057,
            "6c9cca1c85110b446181560750a210b9a51c747e9e5b9a8cf7e210443e13bb7f",
        ),
        (
            binint(13099),
            lora("/adapters/sql-lora".into()),
            65599,
            "0b603bd8632508f73d7c56dc46f5b34a2f2639d0779b5f45cdc6717ad1940f16",
        ),
        (
            vec![7],
            none.clone(),
            54,
            "ad42afba4a7360560993bf7d42e4779856653b1fa26a67489cc9776a59d18d26",
        ),
        (
            vec![7, 300],
            none.clone(),
            57,
            "f37c43bde008a9a869096d39628ac5994a7cc6bf82c3e4724d49d55dcb1ac812",
        ),
        (
            vec![7, 300, 70000],
            none,
            62,
            "f3bf748054f03e582a4f56572b729415432f1b77b561bfc7d339771b0ca4e77e",
        ),
    ];
    for (tokens, extras, len, want) in cases {
        let h = sha256(tokens.len());
        let input = h.hash_input_bytes(None, &tokens, 0, &extras).unwrap();
        assert_eq!(input.len(), len, "block size {}", tokens.len());
        let d = h.hash_block(None, &tokens, 0, &extras).unwrap();
        assert_eq!(d.to_hex(), want, "block size {}", tokens.len());
    }

    // A 70,000-byte LoRA path is written outside any frame ("lora", "big", "p" * 70000).
    let h = sha256(16);
    let mut extras = lora("p".repeat(70_000));
    if let Some(l) = extras.lora.as_mut() {
        l.name = "big".into();
    }
    let tokens: Vec<u32> = (0..16).collect();
    let input = h.hash_input_bytes(None, &tokens, 0, &extras).unwrap();
    assert_eq!(input.len(), 70116);
    assert_eq!(
        h.hash_block(None, &tokens, 0, &extras).unwrap().to_hex(),
        "0a492d81f696114bd31f50dc657b74e942496a922bd49e40a4bcb5ef4313fb8b"
    );
}

#[test]
fn equal_one_char_strings_are_one_pickle_object() {
    // CPython shares one-character strings: LoRA name "a" and salt "a" are the same object,
    // so the salt is written as BINGET 3 (`6803`).
    let extras = RequestExtras {
        lora: Some(Lora {
            name: "a".into(),
            path: "/p".into(),
        }),
        cache_salt: Some("a".into()),
        ..RequestExtras::default()
    };
    let h = sha256(4);
    let input = h.hash_input_bytes(None, &[1, 2, 3, 4], 0, &extras).unwrap();
    assert_eq!(
        hex(&input),
        "80059556000000000000004320066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198\
         94284b014b024b034b0474948c046c6f7261948c0161948c022f709487948c0a63616368655f73616c74\
         9468038694869487942e"
    );
    assert_eq!(
        h.hash_block(None, &[1, 2, 3, 4], 0, &extras)
            .unwrap()
            .to_hex(),
        "b3e5c6bba16082a56f6f0c31530bcb713ca27d0d0f1509a69d211e2c1fc32013"
    );
}

#[test]
fn digest_conversions() {
    let d = BlockDigest::from_hex("00112233445566778899aabbccddeeff").unwrap();
    assert_eq!(d.as_bytes().len(), 16);
    assert_eq!(d.event_hash().0, 0x8899aabbccddeeff);
    assert_eq!(
        d.to_hash_value(EventHashForm::Int),
        HashValue::Int(0x8899aabbccddeeff)
    );
    assert_eq!(
        d.to_hash_value(EventHashForm::Bytes),
        HashValue::Bytes(d.as_bytes().to_vec())
    );
    assert_eq!(
        d.to_hash_value(EventHashForm::Bytes).block_hash(),
        d.event_hash()
    );
    assert_eq!(
        BlockDigest::from_bytes(&[0; 8]),
        Err(HashError::DigestLength(8))
    );
    assert_eq!(BlockDigest::from_hex("zz"), Err(HashError::InvalidHex));
    assert_eq!(BlockDigest::from_hex("abc"), Err(HashError::InvalidHex));
}

#[test]
fn prompt_embeds_key_per_block() {
    let embeds: Vec<u8> = (0..=255u8).cycle().take(2 * 16 * 8 + 5).collect();
    let digests = prompt_embeds_block_digests(&embeds, 8, 16);
    assert_eq!(digests.len(), 2);
    assert_eq!(digests[0], Sha256::digest(&embeds[..128]).to_vec());
    let extras = RequestExtras {
        prompt_embeds_digests: digests.clone(),
        ..RequestExtras::default()
    };
    let h = sha256(16);
    assert_eq!(
        h.event_extra_keys(1, &extras),
        Some(vec![ExtraKeyItem::Bytes(digests[1].clone())])
    );
    assert_eq!(
        h.hash_extra_keys(0, &extras),
        Some(vec![ExtraKeyItem::Array(vec![
            ExtraKeyItem::Str("prompt_embeds".into()),
            ExtraKeyItem::Bytes(digests[0].clone()),
        ])])
    );
    assert!(h.event_extra_keys(2, &extras).is_none());
}

fn random_extras(rng: &mut ChaCha8Rng, len: usize) -> RequestExtras {
    let mut extras = RequestExtras::default();
    if rng.gen_bool(0.3) {
        extras.lora = Some(Lora {
            name: format!("lora-{}", rng.gen_range(0..4)),
            path: "/adapters/x".into(),
        });
    }
    if rng.gen_bool(0.3) {
        extras.cache_salt = Some(["", "t", "tenant-42"][rng.gen_range(0..3)].into());
    }
    // Sorted, disjoint placeholders, as vLLM's are.
    let mut pos = 0;
    while rng.gen_bool(0.5) && pos < len {
        let offset = pos + rng.gen_range(0..40);
        let length = rng.gen_range(0..50);
        extras.mm.push(MmItem {
            identifier: format!("img-{offset}"),
            offset,
            length,
        });
        pos = offset + length;
    }
    extras
}

/// Hashing block by block, or resuming a chain at any block, equals hashing the whole sequence.
#[test]
fn incremental_hashing_equals_whole_sequence() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x6b696e66);
    for round in 0..200 {
        let algo = HashAlgo::ALL[round % 4];
        let block_size = [1, 2, 3, 4, 16, 32][rng.gen_range(0..6)];
        let format = if rng.gen_bool(0.5) {
            ExtraKeysFormat::Tagged
        } else {
            ExtraKeysFormat::Untagged
        };
        let h = BlockHasher::new(algo, block_size, Some("7"), format).unwrap();
        let len = rng.gen_range(0..200);
        let tokens: Vec<u32> = (0..len)
            .map(|_| match rng.gen_range(0..4) {
                0 => rng.gen_range(0..256),
                1 => rng.gen_range(0..70_000),
                2 => rng.gen(),
                _ => rng.gen_range(0..200_000),
            })
            .collect();
        let extras = random_extras(&mut rng, len);
        let whole = h.hash_blocks(&tokens, &extras);
        assert_eq!(whole.len(), len / block_size, "round {round}");

        let mut parent = None;
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let d = h.hash_block(parent.as_ref(), block, i, &extras).unwrap();
            assert_eq!(d, whole[i], "round {round} block {i}");
            parent = Some(d);
        }
        let resume = rng.gen_range(0..=whole.len());
        let parent = resume.checked_sub(1).map(|i| whole[i]);
        let tail = h.hash_blocks_from(parent.as_ref(), &tokens, resume, &extras);
        assert_eq!(tail, whole[resume..], "round {round} resume at {resume}");
    }
}

/// Through a memo (a small one, and a one-slot one overwritten all the time, both shared by hashers of
/// every algorithm, two seeds and several block sizes) hashing equals hashing without one, on
/// prompts that share prefixes, with and without extra keys.
#[test]
fn memoized_hashing_equals_plain_hashing() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x6d656d6f);
    let mut memo = HashMemo::with_slots(4096);
    let mut tiny = HashMemo::with_slots(1);
    let roots: Vec<Vec<u32>> = (0..5)
        .map(|_| (0..96).map(|_| rng.gen_range(0..50)).collect())
        .collect();
    for round in 0..3000 {
        let algo = HashAlgo::ALL[rng.gen_range(0..4)];
        let block_size = [1, 2, 4, 16, 32][rng.gen_range(0..5)];
        let seed = ["7", "8"][rng.gen_range(0..2)];
        let h = BlockHasher::new(algo, block_size, Some(seed), ExtraKeysFormat::Tagged).unwrap();
        let mut tokens = roots[rng.gen_range(0..roots.len())].clone();
        tokens.truncate(rng.gen_range(0..=tokens.len()));
        // Small alphabets make equal blocks under different parents common.
        let extra = rng.gen_range(0..40);
        tokens.extend((0..extra).map(|_| rng.gen_range(0..3)));
        let extras = if rng.gen_bool(0.2) {
            random_extras(&mut rng, tokens.len())
        } else {
            RequestExtras::default()
        };
        let want = h.hash_blocks(&tokens, &extras);
        assert_eq!(
            h.hash_blocks_memo(&tokens, &extras, &mut memo),
            want,
            "round {round}"
        );
        assert_eq!(
            h.hash_blocks_memo(&tokens, &extras, &mut tiny),
            want,
            "round {round}"
        );
    }
    let (hits, misses) = memo.stats();
    assert!(hits > 1000 && misses > 1000, "{hits} hits, {misses} misses");
}

#[test]
fn extras_change_hashes_only_where_they_apply() {
    let h = sha256(16);
    let tokens: Vec<u32> = (0..64).collect();
    let plain = h.hash_blocks(&tokens, &RequestExtras::default());
    let mm = RequestExtras {
        mm: vec![MmItem {
            identifier: "img".into(),
            offset: 40,
            length: 4,
        }],
        ..RequestExtras::default()
    };
    let with_mm = h.hash_blocks(&tokens, &mm);
    assert_eq!(plain[..2], with_mm[..2]);
    assert!(plain[2..].iter().zip(&with_mm[2..]).all(|(a, b)| a != b));
    assert!(!mm.is_empty());
    assert!(RequestExtras {
        cache_salt: Some(String::new()),
        ..RequestExtras::default()
    }
    .is_empty());
}
