// Command extproc-probe checks that an endpoint picker answers Envoy's ext_proc protocol the way
// the Gateway API Inference Extension specifies: it plays the gateway's side of one
// ExternalProcessor.Process stream per request (request headers, then the JSON body as one chunk
// with end_of_stream=true, then a small response so the picker's request lifecycle completes)
// and prints what the picker chose: the x-gateway-destination-endpoint header and the
// envoy.lb dynamic metadata. It exits non-zero when a picker answers without choosing.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	pb "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
)

const destinationHeader = "x-gateway-destination-endpoint"

// pick is what one request's stream told us.
type pick struct {
	Header   string         `json:"header"`
	Metadata map[string]any `json:"metadata,omitempty"`
	Status   string         `json:"immediate_status,omitempty"`
	Messages []string       `json:"messages"`
}

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "the picker's ext_proc gRPC address")
	model := flag.String("model", "sim", "model name in the request body")
	prompt := flag.String("prompt", "The quick brown fox jumps over the lazy dog.", "prompt of every request")
	path := flag.String("path", "/v1/completions", "request :path")
	n := flag.Int("n", 1, "requests to send, one stream each, one after the other")
	mode := flag.String("body-mode", "full-duplex", "request body mode announced in protocol_config: full-duplex or buffered")
	timeout := flag.Duration("timeout", 10*time.Second, "deadline of each stream")
	verbose := flag.Bool("v", false, "print every message the picker sent as JSON")
	flag.Parse()

	bodyMode := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	switch *mode {
	case "full-duplex":
	case "buffered":
		bodyMode = filterv3.ProcessingMode_BUFFERED
	default:
		fmt.Fprintf(os.Stderr, "unknown -body-mode %q\n", *mode)
		os.Exit(2)
	}

	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintf(os.Stderr, "dial %s: %v\n", *addr, err)
		os.Exit(1)
	}
	defer conn.Close()
	client := pb.NewExternalProcessorClient(conn)

	body, err := json.Marshal(map[string]any{"model": *model, "prompt": *prompt, "max_tokens": 1})
	if err != nil {
		fmt.Fprintf(os.Stderr, "body: %v\n", err)
		os.Exit(1)
	}
	failed := false
	for i := 0; i < *n; i++ {
		start := time.Now()
		p, err := probe(client, *timeout, *path, body, bodyMode, *verbose)
		elapsed := time.Since(start)
		if err != nil {
			fmt.Printf("request %d: error after %s: %v\n", i, elapsed.Round(time.Microsecond), err)
			failed = true
			continue
		}
		meta, _ := json.Marshal(p.Metadata)
		fmt.Printf("request %d: %s=%q envoy.lb=%s immediate=%q messages=%s in %s\n", i, destinationHeader,
			p.Header, meta, p.Status, strings.Join(p.Messages, ","), elapsed.Round(time.Microsecond))
		if p.Header == "" && p.Metadata == nil {
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
}

// probe runs one stream: headers, body (end_of_stream), then, once the picker has answered the
// body, the upstream's response headers and body, and reads until the picker closes.
func probe(client pb.ExternalProcessorClient, timeout time.Duration, path string, body []byte,
	bodyMode filterv3.ProcessingMode_BodySendMode, verbose bool) (*pick, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return nil, fmt.Errorf("open stream: %w", err)
	}
	hdr := func(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }
	send := func(r *pb.ProcessingRequest) error {
		if err := stream.Send(r); err != nil {
			return fmt.Errorf("send: %w", err)
		}
		return nil
	}
	if err := send(&pb.ProcessingRequest{
		Request: &pb.ProcessingRequest_RequestHeaders{RequestHeaders: &pb.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				hdr(":method", "POST"), hdr(":path", path), hdr(":authority", "probe"),
				hdr(":scheme", "http"), hdr("content-type", "application/json"),
				hdr("content-length", fmt.Sprint(len(body))),
			}},
		}},
		ProtocolConfig: &pb.ProtocolConfiguration{RequestBodyMode: bodyMode, ResponseBodyMode: bodyMode},
	}); err != nil {
		return nil, err
	}
	if err := send(&pb.ProcessingRequest{
		Request: &pb.ProcessingRequest_RequestBody{RequestBody: &pb.HttpBody{Body: body, EndOfStream: true}},
	}); err != nil {
		return nil, err
	}

	p := &pick{}
	answeredBody, sentResponse := false, false
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			if answeredBody && sentResponse {
				// Some pickers end the stream with an error status once the response is through.
				p.Messages = append(p.Messages, "close:"+err.Error())
				break
			}
			return p, fmt.Errorf("recv: %w", err)
		}
		if verbose {
			js, _ := protojson.Marshal(resp)
			fmt.Printf("  <- %s\n", js)
		}
		collect(p, resp)
		switch resp.Response.(type) {
		case *pb.ProcessingResponse_RequestBody:
			answeredBody = true
		case *pb.ProcessingResponse_RequestHeaders:
			// A picker in buffered style may answer the body by the header response alone; the
			// body answer is awaited below either way.
		case *pb.ProcessingResponse_ImmediateResponse:
			return p, nil
		case *pb.ProcessingResponse_ResponseBody:
			if err := stream.CloseSend(); err != nil {
				return p, fmt.Errorf("close send: %w", err)
			}
		}
		if answeredBody && !sentResponse {
			sentResponse = true
			out := []byte(`{"id":"probe","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}`)
			if err := send(&pb.ProcessingRequest{
				Request: &pb.ProcessingRequest_ResponseHeaders{ResponseHeaders: &pb.HttpHeaders{
					Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
						hdr(":status", "200"), hdr("content-type", "application/json"),
					}},
				}},
			}); err != nil {
				return p, err
			}
			if err := send(&pb.ProcessingRequest{
				Request: &pb.ProcessingRequest_ResponseBody{ResponseBody: &pb.HttpBody{Body: out, EndOfStream: true}},
			}); err != nil {
				return p, err
			}
		}
	}
	return p, nil
}

// collect records the message kind, any destination header it sets and any dynamic metadata.
func collect(p *pick, resp *pb.ProcessingResponse) {
	var common *pb.CommonResponse
	switch r := resp.Response.(type) {
	case *pb.ProcessingResponse_RequestHeaders:
		p.Messages = append(p.Messages, "request_headers")
		common = r.RequestHeaders.GetResponse()
	case *pb.ProcessingResponse_RequestBody:
		p.Messages = append(p.Messages, "request_body")
		common = r.RequestBody.GetResponse()
	case *pb.ProcessingResponse_ResponseHeaders:
		p.Messages = append(p.Messages, "response_headers")
		common = r.ResponseHeaders.GetResponse()
	case *pb.ProcessingResponse_ResponseBody:
		p.Messages = append(p.Messages, "response_body")
		common = r.ResponseBody.GetResponse()
	case *pb.ProcessingResponse_ImmediateResponse:
		p.Messages = append(p.Messages, "immediate")
		p.Status = fmt.Sprintf("%d %s", r.ImmediateResponse.GetStatus().GetCode(), r.ImmediateResponse.GetBody())
	default:
		p.Messages = append(p.Messages, fmt.Sprintf("%T", r))
	}
	for _, h := range common.GetHeaderMutation().GetSetHeaders() {
		if strings.EqualFold(h.GetHeader().GetKey(), destinationHeader) {
			v := h.GetHeader().GetValue()
			if v == "" {
				v = string(h.GetHeader().GetRawValue())
			}
			p.Header = v
		}
	}
	if md := resp.GetDynamicMetadata(); md != nil {
		if p.Metadata == nil {
			p.Metadata = map[string]any{}
		}
		for k, v := range md.AsMap() {
			p.Metadata[k] = v
		}
	}
}
