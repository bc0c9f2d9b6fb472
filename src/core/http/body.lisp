;;;; body.lisp -- the request a handler is serving: its head and its body,
;;;; in bounded memory, and never past the request's end.
;;;;
;;;; Once CHECK-HEAD passed, BEGIN-MESSAGE records the request's framing in
;;;; the connection's REQUEST record.  A body not all buffered yet is then
;;;; read by the engine, in epoll, before the handler runs (GATHER-BODY,
;;;; serve.lisp, with the steps at the end of this file), into a spool
;;;; (spool.lisp); the handler reads it from there (BODY-MODE :SPOOL) and
;;;; never waits for the client.  A body the application streams (the
;;;; engine's STREAMED-BODIES) is read from the connection as the handler
;;;; asks for it.  From then on:
;;;;  - The native layer reads the head from the record (see request.lisp),
;;;;    drops it (CONNECTION-CONSUME-HEAD) and reads the decoded body with
;;;;    CONNECTION-READ-BODY, usually through a BODY-STREAM.
;;;;  - Hunchentoot takes the head from the record too (CONNECTION-TAKE-HEAD,
;;;;    see src/hunchentoot/heads.lisp) and reads the connection as a stream
;;;;    (READ-MESSAGE): the head's octets only where it reads the head itself
;;;;    (HUNCHENTOOT:*HEADER-STREAM* set), then the body.  A Content-Length body is passed on
;;;;    as it is; a chunked body is decoded here and passed on re-chunked
;;;;    into canonical chunks of at most +RECHUNK-SIZE+ octets, without
;;;;    extensions or trailers.  So chunga, Hunchentoot's chunk reader, only
;;;;    ever sees framing Gallop wrote (one reading of every body), and never
;;;;    allocates a buffer for a chunk size the client chose.
;;;;  - Either way, reads end at the end of the request: the body of one
;;;;    request can never be read as the next request.  The engine calls
;;;;    FINISH-MESSAGE after the handler, which skips what the handler left
;;;;    unread if it is already here; if not, the connection closes after
;;;;    the answer (nothing waits for a client's unwanted upload).
;;;;
;;;; Memory: a streamed body holds at most a window of the connection's input
;;;; buffer (8 KiB); a body the engine reads first, its spool's share of the
;;;; body budget (memory) or the disk budget (a temporary file).
;;;;
;;;; A framing error or a chunked body over MAX-BODY-BYTES signals
;;;; REQUEST-BODY-ERROR in the reading code and sets FRAMING-BROKEN: the
;;;; connection closes after the answer.  So does a streamed body that comes
;;;; too slowly (the read timeout, or the minimum data rate: status 408); a
;;;; client that ends its side gives end of file, as any read does.

(in-package #:gallop.core)

(defconstant +rechunk-size+ 65536
  "The largest chunk handed to the layer above when re-chunking.")

(sb-int:defconstant-eqx +last-chunk-octets+
    (encode-ascii (coerce '(#\0 #\Return #\Linefeed #\Return #\Linefeed) 'string))
  #'equalp)

(defun connection-decoder (c)
  (let ((request (connection-request c)))
    (or (request-chunk-decoder request)
        (setf (request-chunk-decoder request) (make-chunk-decoder)))))

(defun begin-message (c)
  "The head just checked on C (CHECK-HEAD) is the request a handler now
serves: record its framing."
  (with-connection-slots (in-start scan engine) c
    (with-request-slots (head-left body-mode body-left body-length chunked synth synth-pos
                         synth-data-left synth-done framing-broken rate-start)
        (connection-request c)
      (setf head-left (- scan in-start)
            (conn-slot c blank-lines) 0
            (conn-slot c line-checked) nil
            framing-broken nil
            synth nil synth-pos 0 synth-data-left 0 synth-done nil
            rate-start 0)
      (cond (chunked
             (setf body-mode :chunked)
             (reset-chunk-decoder (connection-decoder c) (engine-max-body-bytes engine)))
            ((plusp body-length)
             (setf body-mode :length body-left body-length))
            (t (setf body-mode nil))))))

(defun connection-consume-head (c)
  "Drop the request head from the input: what follows is the body."
  (with-connection-slots (in-start scan) c
    (setf in-start scan (request-head-left (connection-request c)) 0)))

(defun connection-detach (c)
  "The layer above keeps C's stream for a protocol of its own (Hunchentoot's
DETACH-SOCKET: a WebSocket, a tunnel): from now on its reads and writes pass
through as they are, past the end of the request just served (what is left
of its head is dropped; a body not read yet is read as it is).  C's input
buffer no longer counts against the head budget.  Called by the handler,
in its worker, which still owns C until the handler returned.  From here on
the stream is its owner's, who may give it to other threads: so everything
written before goes now, in this thread (what the socket did not take yet,
then what the output buffer holds, the answer's head written by Hunchentoot's
SEND-HEADERS), and the worker writes nothing on C after the handler (the
layer above must not flush it either: Hunchentoot's request loop).  Later
writes are blocking sends, from the first; on the engine's TLS, every SSL
call holds C's SSL-LOCK (WITH-SSL).  The change of state is whole or not at
all: a stop's interrupt (INTERRUPT-HANDLER) finds C either served or
detached, never between."
  (with-connection-slots (in-start boundary raw) c
    (with-request-slots (head-left body-mode rate-start) (connection-request c)
      (sb-sys:without-interrupts
        (incf in-start head-left)
        (setf head-left 0
              body-mode nil
              boundary nil
              raw t
              rate-start 0
              (conn-slot c detaching) t)
        (when (and (plusp (the fixnum (conn-slot c tls))) (null (conn-slot c ssl-lock)))
          (setf (conn-slot c ssl-lock) (sb-thread:make-mutex :name "SSL")))
        (release-request-fields (conn-slot c request))
        (release-spool c)
        (uncharge-head c)))
    (handler-case (progn (when (conn-slot c unsent) (finish-unsent c))
                         (flush-output c))
      (connection-error ()
        (discard-unsent c)
        (setf (conn-slot c out-fill) 0)))
    c))

(defun connection-detached-p (c)
  "True once the layer above kept C's stream (CONNECTION-DETACH)."
  (and (conn-slot c detaching) t))

(defun connection-head-pending-p (c)
  "True if the layer above has not read the checked request head yet."
  (plusp (the fixnum (request-head-left (connection-request c)))))

(defun connection-body-pending-p (c)
  "True if the request being served has a body (not all of it read yet)."
  (and (request-body-mode (connection-request c)) t))

(defun body-broken (c condition)
  "Note that C's body framing failed, then signal CONDITION."
  (setf (request-framing-broken (connection-request c)) t)
  (error condition))

(defun ensure-input (c)
  "Make sure C has unread input, blocking (bounded by the read timeout, and
by the minimum data rate for a body read as it arrives: past either,
REQUEST-BODY-ERROR 408, and the connection closes after the answer).
The request is not over, so end of file here means the client went away."
  (with-connection-slots (in-start in-end) c
    (when (and (= in-start in-end)
               (not (let ((began (now-ms)))
                      (handler-case (fill-input c)
                        (connection-timeout-error (e)
                          (when (rate-ended-wait-p c began)
                            (sb-ext:atomic-incf (engine-slow-clients (connection-engine c))))
                          (if (conn-slot c source)
                              (error e) ; TLS through a library: its own reading
                              (body-broken c (make-condition 'request-body-error
                                                             :status 408))))))))
      ;; The client ended its side in the middle of a request: there is no
      ;; request to answer (as nginx, nothing is sent; later sends are
      ;; dropped), and the connection closes.
      (setf (request-framing-broken (connection-request c)) t
            (conn-slot c gone) t)
      (error 'connection-error :stream c :operation "read body"))))

(defun take-input (c vector start end)
  "Copy unread input of C into VECTOR[START,END) (waiting for some if there
is none): at least one octet, at most END - START.  Returns the index after
the last octet copied."
  (declare (type fixnum start end))
  (ensure-input c)
  (with-connection-slots (inbuf in-start in-end) c
    (let ((n (min (- end start) (- in-end in-start))))
      (replace vector (the octets inbuf) :start1 start :end1 (+ start n) :start2 in-start)
      (incf in-start n)
      (+ start n))))

(defun read-chunked-data (c vector start end)
  "Decoded octets of C's chunked body into VECTOR[START,END); returns the
index after the last octet, less than END only at the end of the body."
  (declare (type fixnum start end))
  (when (eq (request-body-mode (connection-request c)) :spool)
    ;; Re-chunking a body the engine read before the handler: its data.
    (return-from read-chunked-data (read-spooled c vector start end)))
  (let ((d (request-chunk-decoder (connection-request c))))
    (with-connection-slots (inbuf in-start in-end) c
      (with-request-slots (body-mode) (connection-request c)
        (loop while (< start end)
              do (case (chunk-decoder-state d)
                   ((nil) (setf body-mode nil) (return))
                   (:data
                    (let ((k (take-input c vector start
                                         (+ start (min (- end start) (chunk-decoder-left d))))))
                      (chunk-decoder-take d (- k start))
                      (setf start k)))
                   (t
                    (ensure-input c)
                    (setf in-start (handler-bind ((request-body-error
                                                    (lambda (e) (body-broken c e))))
                                     (chunk-decoder-step d inbuf in-start in-end))))))
        (when (null (chunk-decoder-state d))
          (setf body-mode nil))
        start))))

(defun connection-read-body (c vector &optional (start 0) (end (length vector)))
  "Read the decoded body of the request C serves into VECTOR[START,END),
blocking (bounded by the read timeout) until it is full or the body ended.
Returns the index after the last octet read.  Signals REQUEST-BODY-ERROR for
a malformed chunked body or one over the limit."
  (declare (type fixnum start end))
  (with-request-slots (body-mode body-left framing-broken) (connection-request c)
    (loop while (and (< start end) (not framing-broken)) ; a broken body has no more octets
          do (case body-mode
               ((nil) (return))
               (:length
                (let ((k (take-input c vector start (+ start (min (- end start) body-left)))))
                  (when (zerop (decf body-left (- k start)))
                    (setf body-mode nil))
                  (setf start k)))
               (:chunked
                (setf start (read-chunked-data c vector start end)))
               (:spool
                (let ((k (read-spooled c vector start end)))
                  (when (= k start)
                    (setf body-mode nil))
                  (setf start k))))))
  start)

(defun read-spooled (c vector start end)
  "The next octets of the body the engine read for C (GATHER-BODY) into
VECTOR[START,END): the index after the last one, START at its end."
  (declare (type fixnum start end))
  (with-request-slots (spool body-left) (connection-request c)
    (if (or (null spool) (<= body-left 0))
        start
        (let ((k (spool-read spool vector start (+ start (min (- end start) body-left)))))
          (decf body-left (- k start))
          k))))

(defun next-chunk-size (c)
  "Decode C's chunked body up to the data of its next chunk: that chunk's
data octets not yet read, or 0 at the end of the body."
  (let ((request (connection-request c)))
    (when (eq (request-body-mode request) :spool)
      (return-from next-chunk-size (max 0 (request-body-left request)))))
  (let ((d (request-chunk-decoder (connection-request c))))
    (with-connection-slots (inbuf in-start in-end) c
      (loop
        (case (chunk-decoder-state d)
          ((nil) (return 0))
          (:data (return (chunk-decoder-left d)))
          (t (ensure-input c)
             (setf in-start (handler-bind ((request-body-error
                                             (lambda (e) (body-broken c e))))
                              (chunk-decoder-step d inbuf in-start in-end)))))))))

(defun read-rechunked (c vector start end)
  "C's chunked body re-chunked (see the header) into VECTOR[START,END);
returns the index after the last octet, less than END only at its end."
  (declare (type fixnum start end))
  (with-request-slots (synth synth-pos synth-data-left synth-done body-mode) (connection-request c)
    (loop while (< start end)
          do (cond (synth
                    (let* ((octets synth)
                           (n (min (- end start) (- (length (the octets octets)) synth-pos))))
                      (replace vector octets :start1 start :end1 (+ start n) :start2 synth-pos)
                      (incf start n)
                      (when (= (incf synth-pos n) (length octets))
                        (setf synth nil synth-pos 0))))
                   ((plusp synth-data-left)
                    (let ((k (read-chunked-data c vector start
                                                (+ start (min (- end start) synth-data-left)))))
                      (when (= k start) ; the decoder says the chunk ended early: impossible
                        (error "READ-RECHUNKED: chunk data ended early on ~A" c))
                      (when (zerop (decf synth-data-left (- k start)))
                        (setf synth +crlf-octets+ synth-pos 0))
                      (setf start k)))
                   (synth-done
                    (setf body-mode nil)
                    (return))
                   (t
                    (let ((size (next-chunk-size c)))
                      (if (zerop size)
                          (setf synth +last-chunk-octets+ synth-pos 0 synth-done t)
                          (let ((n (min size +rechunk-size+)))
                            (setf synth (encode-ascii (format nil "~X~C~C" n #\Return #\Linefeed))
                                  synth-pos 0
                                  synth-data-left n))))))))
  start)

(defun read-message (c vector start end)
  "The request C serves as the layer above reads it through the stream: the
rest of its head, then its body (chunked bodies re-chunked), then nothing.
Returns the index after the last octet read into VECTOR[START,END)."
  (declare (type fixnum start end))
  (with-connection-slots (inbuf in-start) c
    (with-request-slots (head-left body-mode framing-broken chunked) (connection-request c)
      (when (and (plusp head-left) (< start end))
        ;; The head is all buffered: CHECK-HEAD saw it.
        (let ((n (min head-left (- end start))))
          (replace vector (the octets inbuf) :start1 start :end1 (+ start n) :start2 in-start)
          (incf in-start n)
          (decf head-left n)
          (incf start n)))
      (if (and (< start end) (zerop head-left) body-mode
               (not framing-broken))    ; a broken body has no more octets
          (if (or (eq body-mode :chunked)
                  (and (eq body-mode :spool) chunked))
              (read-rechunked c vector start end)
              (connection-read-body c vector start end))
          start))))

(defun read-available-now (c)
  "Read whatever input C has now, without waiting: true if some came."
  (when (conn-slot c source)
    ;; TLS: whether the TLS stream has more can't be asked without blocking
    ;; (see FILL-FROM-SOURCE); what was not read yet closes the connection.
    (return-from read-available-now nil))
  (with-connection-slots (inbuf in-start in-end scan) c
    (let ((buffer (ensure-inbuf c)))
      (when (= in-start in-end)
        (setf in-start 0 in-end 0 scan 0))
      (and (< in-end (length buffer))
           (multiple-value-bind (n errno) (connection-recv c buffer in-end (length buffer))
             (declare (ignore errno))
             (setf (conn-slot c drained) (< n (- (length buffer) in-end)))
             (when (plusp n)
               (incf in-end n)
               t))))))

(defconstant +max-skip-reads+ 8
  "How many reads of input that is already there FINISH-MESSAGE makes to skip
an unread body, before it gives up and lets the connection close.")

(defun finish-message (c)
  "After the handler: skip what it left unread of its request (head octets,
body) in the input that is here.  True when the next request starts at
IN-START; NIL when the rest has not all arrived, or the framing is broken:
then the connection must close after the answer."
  (with-connection-slots (inbuf in-start in-end raw request) c
    (with-request-slots (head-left body-mode body-left framing-broken rate-start begun spool
                         chunk-decoder)
        request
      (incf in-start head-left)
      (setf head-left 0
            rate-start 0
            ;; For the metrics: what C reads next is not this request.
            begun 0)
      (release-request-fields request)
      (when spool
        ;; The engine read the whole body: what the handler left of it goes.
        (release-spool c)
        (when (eq body-mode :spool)
          (setf body-mode nil)))
      (cond
        ((or raw (null body-mode))        ; TLS reads its requests itself; or no body left
         (not framing-broken))
        (framing-broken nil)
        (t
         (let ((reads 0))
           (declare (type fixnum reads))
           (handler-case
               (loop
                 (let ((available (- in-end in-start)))
                   (case body-mode
                     ((nil) (return t))
                     (:length
                      (let ((n (min body-left available)))
                        (incf in-start n)
                        (when (zerop (decf body-left n))
                          (setf body-mode nil))))
                     (:chunked
                      (let ((d chunk-decoder))
                        (case (chunk-decoder-state d)
                          ((nil) (setf body-mode nil))
                          (:data (let ((n (min (chunk-decoder-left d) available)))
                                   (incf in-start n)
                                   (chunk-decoder-take d n)))
                          (t (setf in-start (chunk-decoder-step d inbuf in-start in-end))))))))
                 (when (and body-mode (= in-start in-end)
                            (or (>= (incf reads) +max-skip-reads+)
                                (not (read-available-now c))))
                   (return nil)))
             (request-body-error ()
               (setf framing-broken t)
               nil))))))))

;;; The native layer's view of a body: a binary input stream.

(defclass body-stream (sb-gray:fundamental-binary-input-stream)
  ((connection :initarg :connection)
   (continue :initarg :continue :initform nil
             :documentation "True until the first read, if the client sent
Expect: 100-continue: that read first answers 100 Continue.")
   (octet :initform (make-array 1 :element-type '(unsigned-byte 8))))
  (:documentation "The body of the request a connection serves, decoded, as
it arrives: end of file at the end of the body."))

(defun make-body-stream (c &key continue)
  "A BODY-STREAM over the request C serves.  With CONTINUE, the first read
sends 100 Continue first (RFC 9110, 10.1.1: only once the body is wanted)."
  (make-instance 'body-stream :connection c :continue continue))

(defmethod stream-element-type ((s body-stream))
  '(unsigned-byte 8))

(defun body-stream-start (s)
  (with-slots (connection continue) s
    (when continue
      (setf continue nil)
      (when (and (zerop (the fixnum (conn-slot connection sent)))
                 (connection-body-pending-p connection))
        (connection-write-octets connection +response-100+)
        (flush-output connection)
        ;; An interim answer is not the response: it must not count as one.
        (setf (conn-slot connection sent) 0)))
    connection))

(defmethod sb-gray:stream-read-sequence ((s body-stream) sequence &optional (start 0) end)
  (let ((c (body-stream-start s)))
    (connection-read-body c sequence start (or end (length sequence)))))

(defmethod sb-gray:stream-read-byte ((s body-stream))
  (let ((c (body-stream-start s))
        (octet (slot-value s 'octet)))
    (if (= 1 (connection-read-body c octet 0 1))
        (aref octet 0)
        :eof)))

(defmethod sb-gray:stream-listen ((s body-stream))
  (let ((c (slot-value s 'connection)))
    (and (connection-body-pending-p c)
         (if (eq (request-body-mode (connection-request c)) :spool)
             (plusp (request-body-left (connection-request c)))
             (< (conn-slot c in-start) (conn-slot c in-end))))))

;;; Reading a body before the handler.  The engine reads a request's body as
;;; it arrives, between epoll events, into a spool (spool.lisp), and runs the
;;; handler once all of it is here: a client sending its body slowly holds a
;;; parked connection, not a worker (doc/design.md, "A slow body holds no
;;; worker").  The body is read into the input buffer after the head, whose
;;; octets stay where they are (the request record indexes them), and moved
;;; to the spool from there; what follows the body (a pipelined request)
;;; stays after the head, where FINISH-MESSAGE finds it.  Its deadline is the
;;; read timeout from the last octets, or sooner under the minimum data
;;; rate (PARK); past it, 408.  The worker's side, which reads, parks and
;;; rejects, is GATHER-BODY (serve.lisp).

(defconstant +gather-room+ 4096
  "The least room after the head in the input buffer to read a body into;
with less, the buffer grows (charged to the head budget).")

(defun request-path (c)
  "The path of the request C serves (its target without the query), as a
string of its octets."
  (let* ((r (conn-slot c request))
         (buffer (conn-slot c inbuf))
         (start (request-target-start r))
         (path (make-string (- (request-query-start r) start))))
    (declare (type octets buffer) (type fixnum start))
    (dotimes (i (length path) path)
      (setf (char path i) (code-char (aref buffer (+ start i)))))))

(defun streamed-body-p (c)
  "True when the application reads the body of C's request as it arrives
\(the engine's STREAMED-BODIES says so for its method and path).  An error
in that function is logged, and the body read first."
  (let* ((engine (connection-engine c))
         (streamed (engine-streamed-bodies engine)))
    (and streamed
         (handler-case (funcall streamed (request-method (conn-slot c request)) (request-path c))
           (error (e)
             (log-engine-error engine "STREAMED-BODIES failed on ~A: ~A" c e)
             nil)))))

(defun gather-body-p (c)
  "After BEGIN-MESSAGE: whether the engine reads the body of C's request
before the handler runs (GATHER-BODY).  Not when there is none, or all of it
is buffered already, or the engine does not read C's requests itself (RAW),
or the application streams it (STREAMED-BODIES): then the minimum data rate
bounds the handler's reads of it."
  (with-connection-slots (in-start in-end raw) c
    (with-request-slots (body-mode body-left head-left rate-start rate-octets)
        (connection-request c)
      (cond ((or (null body-mode) raw) nil)
            ((and (eq body-mode :length) (<= body-left (- in-end in-start head-left))) nil)
            ((streamed-body-p c)
             (setf rate-start (now-ms)
                   rate-octets (- in-end in-start head-left))
             nil)
            (t t)))))

(defun begin-gathering (c)
  "Start reading C's request body before the handler (GATHER-BODY).  A
client that sent Expect: 100-continue is told to send the body now, and the
layers above see no such expectation left.  The minimum data rate counts
every octet of the body, those that came in the reads of its head too
\(buffered after it), as GATHER-BODY-P does for a streamed body: where the
client's writes split head and body must not move its deadline."
  (let ((now (now-ms)))
    (with-request-slots (spool gathering progress rate-start rate-octets head-left
                         expect-continue)
        (connection-request c)
      (setf spool (make-spool)
            gathering t
            progress now
            rate-start now
            rate-octets (- (conn-slot c in-end) (conn-slot c in-start) head-left))
      (when expect-continue
        (setf expect-continue nil)
        ;; A client gone already is found by the next read.
        (handler-case (connection-write-continue c)
          (connection-error () nil))))))

(defun body-gathered-p (c)
  (with-request-slots (body-mode body-left chunk-decoder) (connection-request c)
    (case body-mode
      (:length (zerop body-left))
      (:chunked (null (chunk-decoder-state chunk-decoder)))
      (t t))))

(defun spool-input (c start end)
  "Move the body octets of C's input buffer from START (before END) to its
spool: the index after the last one taken (less than END only at the end of
the body), or NIL when the spool could not hold them.  Signals
REQUEST-BODY-ERROR for a malformed chunked body, or one over the limit."
  (declare (type fixnum start end))
  (with-connection-slots (inbuf engine) c
    (with-request-slots (body-mode body-left spool chunk-decoder) (connection-request c)
      (ecase body-mode
        (:length
         (let ((n (min body-left (- end start))))
           (and (spool-append engine spool inbuf start (+ start n))
                (progn (decf body-left n)
                       (+ start n)))))
        (:chunked
         (let ((d chunk-decoder))
           (loop while (< start end)
                 do (case (chunk-decoder-state d)
                      ((nil) (return))
                      (:data
                       (let ((n (min (chunk-decoder-left d) (- end start))))
                         (unless (spool-append engine spool inbuf start (+ start n))
                           (return-from spool-input nil))
                         (chunk-decoder-take d n)
                         (incf start n)))
                      (t (setf start (chunk-decoder-step d inbuf start end)))))
           start))))))

(defun room-after-head (c)
  "Make room after IN-END in C's input buffer to read body octets into: move
the head (and what follows it) to the front when octets of earlier requests
are before it, the request record's indexes with it (SHIFT-REQUEST), else
grow the buffer.  True when there is some room."
  (with-connection-slots (inbuf in-start in-end scan) c
    (let ((buffer inbuf))
      (declare (type octets buffer))
      (when (and (< (- (length buffer) in-end) +gather-room+) (plusp in-start))
        ;; A pipelining client's heads follow each other along the buffer:
        ;; growing it instead would grow it with every request.
        (let ((delta (- in-start)))
          (replace buffer buffer :start2 in-start :end2 in-end)
          (shift-request (conn-slot c request) delta)
          (incf in-end delta)
          (incf scan delta)
          (setf in-start 0)))
      (or (>= (- (length buffer) in-end) +gather-room+)
          (let ((size (+ in-end +buffer-size+)))
            (if (charge-growth c size)
                (let ((bigger (make-array size :element-type '(unsigned-byte 8))))
                  (replace bigger buffer :end2 in-end)
                  (release-buffer buffer)
                  (setf inbuf bigger)
                  t)
                (< in-end (length buffer))))))))
