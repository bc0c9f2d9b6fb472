;;;; gather.lisp -- request bodies read in epoll before the handler runs
;;;; (src/core/http/spool.lisp, serve.lisp's GATHER-BODY), and the minimum
;;;; data rate of heads, bodies and answers, on both front ends.
;;;;
;;;; Pure tests on the spool first (memory, then a temporary file, under
;;;; their budgets), then tests over sockets: a slow body holds no worker
;;;; (one worker, and another client is served while a body is half sent);
;;;; bodies past the memory threshold arrive exactly, framed either way,
;;;; with a pipelined request behind them; 100 Continue is sent once, by
;;;; the engine; a head or body under the minimum rate gets 408 long before
;;;; the timeouts; a body past the disk budget gets 503; an answer nobody
;;;; reads is closed by the rate, not the write timeout.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the spool on its own
;;;; (http/spool.lisp), the data-rate deadlines, a connection's state and the
;;;; engine's body counters (http/, loop/serve.lisp): what is gathered before
;;;; a handler runs is not visible from a handler.

(in-package #:gallop-tests)

(in-suite core)

;;; The spool, on bytes

(defun spool-test-engine (&key (buffer 20000) (budget 1000000) (disk 1000000))
  (gallop.core::%make-engine :body-buffer-bytes buffer :body-budget budget :disk-budget disk
                             :temp-directory (gallop.core::temp-directory-name
                                              (namestring (run-directory)))))

(defun gather-octets (n &optional (seed 7))
  "N octets of every value, in an order that repeats only after 251 octets."
  (let ((octets (make-array n :element-type '(unsigned-byte 8))))
    (dotimes (i n octets)
      (setf (aref octets i) (mod (+ seed (* i 7) (floor i 251)) 256)))))

(defun spool-round-trip (engine body piece read-size)
  "Append BODY to a new spool in pieces of PIECE octets, read it back in
reads of READ-SIZE; (values octets-read spool), or NIL when an append failed."
  (let ((spool (gallop.core::make-spool)))
    (loop for start from 0 below (length body) by piece
          do (unless (gallop.core::spool-append engine spool body start
                                                (min (length body) (+ start piece)))
               (return-from spool-round-trip (values nil spool))))
    (let ((out (make-array (length body) :element-type '(unsigned-byte 8)))
          (at 0))
      (loop (let ((next (gallop.core::spool-read spool out at (min (length out) (+ at read-size)))))
              (when (= next at) (return))
              (setf at next)))
      (values (subseq out 0 at) spool))))

(test a-spool-keeps-a-body-in-memory-then-in-a-file
  (dolist (size '(0 1 8191 8192 8193 20000 20001 70000))
    (dolist (piece '(1 1000 8192 100000))
      (unless (and (= piece 1) (> size 9000))
        (let ((engine (spool-test-engine))
              (body (gather-octets size)))
          (multiple-value-bind (out spool) (spool-round-trip engine body piece 3000)
            (is (equalp body out) "~D octets in pieces of ~D: read back differently" size piece)
            (is (eq (> size 20000) (>= (gallop.core::spool-fd spool) 0))
                "~D octets: ~:[in memory~;in a file~]" size (>= (gallop.core::spool-fd spool) 0))
            (is (= (gallop.core::engine-body-bytes engine)
                   (if (> size 20000) 0 (* 8192 (ceiling size 8192)))))
            (is (= (gallop.core::engine-disk-bytes engine) (if (> size 20000) size 0)))
            (gallop.core::free-spool engine spool)
            (is (zerop (gallop.core::engine-body-bytes engine)))
            (is (zerop (gallop.core::engine-disk-bytes engine)))
            (is (= -1 (gallop.core::spool-fd spool)))))))))

(test a-spool-goes-to-a-file-when-the-memory-budget-is-spent
  (let* ((engine (spool-test-engine :budget 16384))
         (body (gather-octets 10000)))
    (multiple-value-bind (out first) (spool-round-trip engine body 4000 100000)
      (is (equalp body out))
      (is (minusp (gallop.core::spool-fd first)) "the first body is in memory")
      (multiple-value-bind (out second) (spool-round-trip engine body 4000 100000)
        (is (equalp body out))
        (is (>= (gallop.core::spool-fd second) 0) "past the budget, the second is in a file")
        (is (= 16384 (gallop.core::engine-body-bytes engine)))
        (is (= 10000 (gallop.core::engine-disk-bytes engine)))
        (gallop.core::free-spool engine first)
        (gallop.core::free-spool engine second)
        (is (zerop (gallop.core::engine-body-bytes engine)))
        (is (zerop (gallop.core::engine-disk-bytes engine)))))))

(test a-spool-refuses-a-body-past-the-disk-budget
  (let* ((engine (spool-test-engine :buffer 8192 :disk 50000))
         (body (gather-octets 50001)))
    (multiple-value-bind (out spool) (spool-round-trip engine body 5000 100000)
      (is (null out))
      (is (<= (gallop.core::engine-disk-bytes engine) 50000))
      (gallop.core::free-spool engine spool)
      (is (zerop (gallop.core::engine-disk-bytes engine))))
    (let ((body (gather-octets 50000)))
      (multiple-value-bind (out spool) (spool-round-trip engine body 5000 100000)
        (is (equalp body out) "a body just within the budget is held")
        (gallop.core::free-spool engine spool)))))

(test the-rate-deadline-follows-the-octets
  (let ((engine (gallop.core::%make-engine :min-rate 240 :rate-grace-ms 5000)))
    (is (= 5000 (gallop.core::rate-deadline engine 0 0)))
    (is (= 5000 (gallop.core::rate-deadline engine 0 1200)))
    (is (= 10000 (gallop.core::rate-deadline engine 0 2400)))
    (is (= 1010000 (gallop.core::rate-deadline engine 10000 240000))))
  (is (null (gallop.core::rate-deadline (gallop.core::%make-engine :min-rate 0) 0 0))))

;;; Over sockets

(defun gather-native-app (env)
  (let ((path (getf env :path-info)))
    (cond ((string= path "/gather-echo")
           (let ((in (getf env :raw-body))
                 (out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0))
                 (buffer (make-array 3000 :element-type '(unsigned-byte 8))))
             (loop for n = (read-sequence buffer in)
                   while (plusp n)
                   do (loop for i below n do (vector-push-extend (aref buffer i) out)))
             (list 200 '(:content-type "application/octet-stream")
                   (coerce out '(simple-array (unsigned-byte 8) (*))))))
          ((string= path "/gather-big")
           (list 200 '(:content-type "application/octet-stream")
                 (make-array (* 32 1024 1024) :element-type '(unsigned-byte 8))))
          (t '(200 (:content-type "text/plain") ("pong"))))))

(hunchentoot:define-easy-handler (handle-gather-echo :uri "/gather-echo") ()
  (setf (hunchentoot:content-type*) "application/octet-stream")
  (or (hunchentoot:raw-post-data :force-binary t)
      (make-array 0 :element-type '(unsigned-byte 8))))

(hunchentoot:define-easy-handler (handle-gather-ping :uri "/gather-ping") ()
  (setf (hunchentoot:content-type*) "text/plain")
  "pong")

(defmacro with-gather-front-end ((port server kind options) &body body)
  "WITH-FRONT-END, the native server serving GATHER-NATIVE-APP."
  `(call-with-front-end ,kind ,options
                        (lambda (,port ,server) (declare (ignorable ,server)) ,@body)
                        :app #'gather-native-app))

(defun send-octets (socket octets &key (start 0) (end (length octets)))
  (let ((stream (usocket:socket-stream socket)))
    (write-sequence octets stream :start start :end end)
    (finish-output stream)))

(defun check-echo (what answer body)
  "ANSWER is a 200 framed by Content-Length whose body is exactly BODY."
  (cond ((not (wire-response-p answer))
         (fail "~A: not a valid answer: ~A" what answer))
        (t
         (is (= 200 (wire-status answer)) "~A: status ~D" what (wire-status answer))
         (is (eq :content-length (wire-framing answer)) "~A: framed by ~A" what
             (wire-framing answer))
         (is (equalp body (wire-body answer)) "~A: ~D octets back, ~D sent~@[, first difference at ~D~]"
             what (length (wire-body answer)) (length body)
             (mismatch body (wire-body answer))))))

(defun check-pong (what answer)
  (is (and (wire-response-p answer) (= 200 (wire-status answer))
           (string= "pong" (wire-body-string answer)))
      "~A: ~A" what answer))

(defun chunked-octets (body chunk)
  "BODY in the chunked coding, in chunks of CHUNK octets (hex sizes in
lower case, one with an extension), then the last chunk and a trailer."
  (let ((out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (flet ((put (string) (loop for ch across string do (vector-push-extend (char-code ch) out))))
      (loop for start from 0 below (length body) by chunk
            for i from 0
            for end = (min (length body) (+ start chunk))
            do (put (format nil "~(~X~)~:[~;;ext=1~]~C~C" (- end start) (= i 1) #\Return #\Linefeed))
               (loop for k from start below end do (vector-push-extend (aref body k) out))
               (put (format nil "~C~C" #\Return #\Linefeed)))
      (put (crlf "0" "X-Trailer: t")))
    (coerce out '(simple-array (unsigned-byte 8) (*)))))

(defun check-a-slow-body-holds-no-worker (kind)
  ;; One worker.  A client sends its head and a tenth of its body, then
  ;; waits: another client is answered meanwhile (a worker reading that
  ;; body would hold the only one for the read timeout); then the rest of
  ;; the body comes, and its echo is exact, on a connection that goes on.
  (with-gather-front-end (port server kind '(:max-thread-count 1 :standby-thread-count 1))
    (let ((slow (connect port))
          (body (gather-octets 50000)))
      (unwind-protect
           (progn
             (send slow (crlf "POST /gather-echo HTTP/1.1" "Host: x" "Content-Length: 50000"))
             (send-octets slow body :end 5000)
             (is (wait-until (lambda () (plusp (stat server :body-bytes)))) "~(~A~): no body held" kind)
             (let ((other (connect port)))
               (unwind-protect
                    (progn (send other (crlf "GET /gather-ping HTTP/1.1" "Host: x"))
                           (check-pong (format nil "~(~A~): another client during the body" kind)
                                       (read-wire-or-error other :persistent t)))
                 (usocket:socket-close other)))
             (send-octets slow body :start 5000)
             (check-echo (format nil "~(~A~): the slow body" kind)
                         (read-wire-or-error slow :persistent t) body)
             (send slow (crlf "GET /gather-ping HTTP/1.1" "Host: x"))
             (check-pong (format nil "~(~A~): the next request" kind)
                         (read-wire-or-error slow :persistent t))
             (is (zerop (stat server :body-bytes)))
             (is (zerop (stat server :disk-bytes))))
        (usocket:socket-close slow)))))

(test a-slow-body-holds-no-worker-native
  (check-a-slow-body-holds-no-worker :native))

(test a-slow-body-holds-no-worker-easy-acceptor
  (check-a-slow-body-holds-no-worker :easy))

(defun check-bodies-past-memory-arrive-exactly (kind)
  ;; Bodies of 100,000 octets with 8 KiB kept in memory: each goes to a
  ;; temporary file.  Content-Length and chunked, written in pieces of
  ;; 7,001 octets, each followed in the same write by a pipelined GET.
  (with-gather-front-end (port server kind '(:body-buffer-bytes 8192))
    (let ((body (gather-octets 100000 3)))
      (dolist (framing '(:length :chunked))
        (let ((socket (connect port))
              (what (format nil "~(~A~), ~(~A~)" kind framing)))
          (unwind-protect
               (let* ((head (if (eq framing :length)
                                (crlf "POST /gather-echo HTTP/1.1" "Host: x" "Content-Length: 100000")
                                (crlf "POST /gather-echo HTTP/1.1" "Host: x"
                                      "Transfer-Encoding: chunked")))
                      (all (concatenate '(vector (unsigned-byte 8))
                                        (octets head)
                                        (if (eq framing :length) body (chunked-octets body 4099))
                                        (octets (crlf "GET /gather-ping HTTP/1.1" "Host: x")))))
                 (loop for start from 0 below (length all) by 7001
                       do (send-octets socket all :start start :end (min (length all) (+ start 7001))))
                 (check-echo what (read-wire-or-error socket :persistent t) body)
                 (check-pong (format nil "~A: the pipelined request" what)
                             (read-wire-or-error socket :persistent t)))
            (usocket:socket-close socket))))
      (is (<= 2 (stat server :body-files)) "~(~A~): ~D bodies went to a file" kind
          (stat server :body-files))
      (is (wait-until (lambda () (and (zerop (stat server :body-bytes))
                                      (zerop (stat server :disk-bytes)))))
          "~(~A~): bodies still held: ~S" kind (gallop:stats server)))))

(test bodies-past-memory-arrive-exactly-native
  (check-bodies-past-memory-arrive-exactly :native))

(test bodies-past-memory-arrive-exactly-easy-acceptor
  (check-bodies-past-memory-arrive-exactly :easy))

(hunchentoot:define-easy-handler (handle-gather-multipart :uri "/gather-multipart") ()
  ;; Hunchentoot's multipart parsing (rfc2388, the file in a temporary
  ;; file), from a body Gallop read first: the note, the file's length and
  ;; the sum of its octets.
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((file (hunchentoot:post-parameter "file")))
    (with-open-file (in (first file) :element-type '(unsigned-byte 8))
      (let ((octets (make-array (file-length in) :element-type '(unsigned-byte 8))))
        (read-sequence octets in)
        (format nil "~A ~D ~D" (hunchentoot:post-parameter "note") (length octets)
                (reduce #'+ octets))))))

(test a-multipart-upload-read-first-reaches-hunchentoot-exactly
  (with-gather-front-end (port server :easy '(:body-buffer-bytes 8192))
    (let* ((file (gather-octets 100000 5))
           (body (concatenate '(vector (unsigned-byte 8))
                              (octets (format nil "--gallop-7f3a~C~CContent-Disposition: form-data; name=\"note\"~C~C~C~Chello~C~C--gallop-7f3a~C~CContent-Disposition: form-data; name=\"file\"; filename=\"f.bin\"~C~CContent-Type: application/octet-stream~C~C~C~C"
                                              #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed
                                              #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed
                                              #\Return #\Linefeed #\Return #\Linefeed))
                              file
                              (octets (format nil "~C~C--gallop-7f3a--~C~C"
                                              #\Return #\Linefeed #\Return #\Linefeed))))
           (all (concatenate '(vector (unsigned-byte 8))
                             (octets (crlf "POST /gather-multipart HTTP/1.1" "Host: x"
                                           "Content-Type: multipart/form-data; boundary=gallop-7f3a"
                                           (format nil "Content-Length: ~D" (length body))))
                             body))
           (socket (connect port)))
      (unwind-protect
           (progn
             (loop for start from 0 below (length all) by 7001
                   do (send-octets socket all :start start :end (min (length all) (+ start 7001))))
             (let ((answer (read-wire-or-error socket :persistent t))
                   (expected (format nil "hello 100000 ~D" (reduce #'+ file))))
               (is (and (wire-response-p answer) (= 200 (wire-status answer))
                        (string= expected (wire-body-string answer)))
                   "~A, expected ~S" answer expected)))
        (usocket:socket-close socket))
      (is (<= 1 (stat server :body-files))))))

(defun check-one-100-continue (kind)
  ;; The client waits for 100 Continue before its body: the engine sends
  ;; it, exactly once; the answer follows the body.
  (with-gather-front-end (port server kind nil)
    (let ((socket (connect port))
          (body (gather-octets 20000)))
      (unwind-protect
           (let ((stream (usocket:socket-stream socket)))
             (send socket (crlf "POST /gather-echo HTTP/1.1" "Host: x" "Content-Length: 20000"
                                "Expect: 100-continue"))
             (let ((interim (make-array (length *continue-octets*) :element-type '(unsigned-byte 8))))
               (is (= (length interim) (read-sequence interim stream)))
               (is (equalp *continue-octets* interim) "~(~A~): ~S" kind (latin1 interim)))
             (send-octets socket body)
             (check-echo (format nil "~(~A~): after 100 Continue" kind)
                         (read-wire-or-error socket :persistent t) body))
        (usocket:socket-close socket)))))

(test one-100-continue-native
  (check-one-100-continue :native))

(test one-100-continue-easy-acceptor
  (check-one-100-continue :easy))

(defun check-under-the-minimum-rate (kind)
  ;; Timeouts of 60 s, a minimum rate of 240 octets a second after 1 s:
  ;; a head, and a body read by the engine, that stop early get 408 within
  ;; the client's 10 s, counted as slow clients.
  (with-gather-front-end (port server kind '(:header-timeout 60 :read-timeout 60
                                             :min-data-rate-grace 1))
    (dolist (case `(("a head" ,(format nil "GET /gather-ping HTTP/1.1~C~CHost: x~C~CX-Slow: "
                                       #\Return #\Linefeed #\Return #\Linefeed))
                    ("a body" ,(concatenate 'string
                                            (crlf "POST /gather-echo HTTP/1.1" "Host: x"
                                                  "Content-Length: 1000")
                                            "0123456789"))))
      (destructuring-bind (what request) case
        (let ((socket (connect port)))
          (unwind-protect
               (progn (send socket request)
                      (check-gallop-answer (format nil "~(~A~): ~A under the rate" kind what)
                                           (read-wire-or-error socket :close t) 408))
            (usocket:socket-close socket)))))
    (is (= 2 (stat server :slow-clients)) "~(~A~): ~S" kind (gallop:stats server))))

(test heads-and-bodies-under-the-minimum-rate-get-408-native
  (check-under-the-minimum-rate :native))

(test heads-and-bodies-under-the-minimum-rate-get-408-easy-acceptor
  (check-under-the-minimum-rate :easy))

;;; The rate counts every octet of a body, those that came with its head too:
;;; the deadline the engine computed is read from its connection.

(defun front-end-engine (server)
  "The engine under SERVER, a native server or a Gallop acceptor."
  (if (typep server 'hunchentoot:acceptor)
      (gallop::taskmaster-engine (gallop::acceptor-gallop-taskmaster server))
      (gallop::server-engine server)))

(defun find-connection (server predicate)
  "A connection of SERVER's engine that satisfies PREDICATE, once one does
\(NIL after WAIT-UNTIL's timeout)."
  (let ((found nil))
    (wait-until (lambda ()
                  (setf found (find-if (lambda (c) (and c (funcall predicate c)))
                                       (gallop.core::engine-table (front-end-engine server))))))
    found))

(defun check-body-octets-with-the-head-count (kind streamed)
  ;; 4,500 body octets of 60,000 in the write of the head, then a pause: at
  ;; 240 octets a second they buy 18,750 ms from the start of the body,
  ;; past the grace of 1 s (the deadline with them uncounted).  The engine
  ;; reads the body first (its connection parked in epoll until that
  ;; deadline) or the handler reads it (waiting at most until it); then
  ;; the rest comes, and the body is echoed whole.
  (with-gather-front-end (port server kind `(:header-timeout 60 :read-timeout 60
                                             :min-data-rate 240 :min-data-rate-grace 1
                                             ,@(and streamed
                                                    (list :streamed-bodies (constantly t)))))
    (let ((socket (connect port))
          (body (gather-octets 60000))
          (what (format nil "~(~A~), ~:[read first~;streamed~]" kind streamed)))
      (unwind-protect
           (progn
             (send-octets socket (concatenate '(vector (unsigned-byte 8))
                                              (octets (crlf "POST /gather-echo HTTP/1.1" "Host: x"
                                                            "Content-Length: 60000"))
                                              (subseq body 0 4500)))
             (let ((c (find-connection server
                                       (lambda (c)
                                         (let ((r (gallop.core::connection-request c)))
                                           (and (plusp (gallop.core::request-rate-start r))
                                                (if streamed
                                                    (= 4500 (gallop.core::request-rate-octets r))
                                                    ;; Parked with all 4,500 in its spool.
                                                    (and (gallop.core::request-gathering r)
                                                         (eq :parked (gallop.core::connection-state c))
                                                         (= 4500 (gallop.core::spool-fill
                                                                  (gallop.core::request-spool r)))))))))))
               (if (null c)
                   (fail "~A: no connection reading the body: ~S" what (gallop:stats server))
                   (let* ((r (gallop.core::connection-request c))
                          (start (gallop.core::request-rate-start r)))
                     (is (= 4500 (gallop.core::request-rate-octets r)) "~A: ~D octets counted"
                         what (gallop.core::request-rate-octets r))
                     (is (eql (+ start 18750) (gallop.core::body-rate-deadline c))
                         "~A: rate deadline ~D ms after the body began" what
                         (- (gallop.core::body-rate-deadline c) start))
                     (unless streamed
                       (is (= (+ start 18750) (gallop.core::connection-deadline c))
                           "~A: parked until ~D ms after the body began" what
                           (- (gallop.core::connection-deadline c) start))))))
             (send-octets socket body :start 4500)
             (check-echo what (read-wire-or-error socket :persistent t) body))
        (usocket:socket-close socket)))
    (is (zerop (stat server :slow-clients)) "~(~A~): ~S" kind (gallop:stats server))))

(test body-octets-with-the-head-count-toward-the-rate-native
  (check-body-octets-with-the-head-count :native nil)
  (check-body-octets-with-the-head-count :native t))

(test body-octets-with-the-head-count-toward-the-rate-easy-acceptor
  (check-body-octets-with-the-head-count :easy nil)
  (check-body-octets-with-the-head-count :easy t))

(defun check-a-streamed-body-under-the-rate (kind)
  ;; A body streamed to its handler (:STREAMED-BODIES) that stops: the
  ;; handler's read ends with 408, and the connection closes.
  (with-gather-front-end (port server kind (list :read-timeout 60 :min-data-rate-grace 1
                                                 :streamed-bodies (constantly t)))
    (let ((socket (connect port)))
      (unwind-protect
           (progn (send socket (concatenate 'string
                                            (crlf "POST /gather-echo HTTP/1.1" "Host: x"
                                                  "Content-Length: 1000")
                                            "0123456789"))
                  (let ((answer (read-wire-or-error socket :close t)))
                    (is (and (wire-response-p answer) (= 408 (wire-status answer))
                             (wire-flag-p answer :eof))
                        "~(~A~): ~A" kind answer)))
        (usocket:socket-close socket)))
    (is (= 1 (stat server :slow-clients)) "~(~A~): ~S" kind (gallop:stats server))
    (is (zerop (stat server :body-files)))))

(test a-streamed-body-under-the-minimum-rate-gets-408-native
  (check-a-streamed-body-under-the-rate :native))

(test a-streamed-body-under-the-minimum-rate-gets-408-easy-acceptor
  (check-a-streamed-body-under-the-rate :easy))

(defun check-the-disk-budget (kind)
  (with-gather-front-end (port server kind '(:body-buffer-bytes 8192 :body-disk-budget 50000))
    (let ((socket (connect port))
          (body (gather-octets 60000)))
      (unwind-protect
           (progn (send socket (crlf "POST /gather-echo HTTP/1.1" "Host: x" "Content-Length: 60000"))
                  (send-octets socket body)
                  (check-gallop-answer (format nil "~(~A~): past the disk budget" kind)
                                       (read-wire-or-error socket :close t) 503))
        (usocket:socket-close socket)))
    (is (wait-until (lambda () (zerop (stat server :disk-bytes)))))))

(test a-body-past-the-disk-budget-gets-503-native
  (check-the-disk-budget :native))

(test a-body-past-the-disk-budget-gets-503-easy-acceptor
  (check-the-disk-budget :easy))

(test an-answer-nobody-reads-ends-at-the-minimum-rate
  ;; 32 MiB the client never reads, a write timeout of 60 s, and a minimum
  ;; rate after 1 s: the server closes the connection within the client's
  ;; 15 s, and counts it as a write timeout of a slow client.
  (with-gather-front-end (port server :native '(:write-timeout 60 :min-data-rate-grace 1))
    (let ((socket (connect port)))
      (unwind-protect
           (progn (send socket (crlf "GET /gather-big HTTP/1.1" "Host: x"))
                  (is (wait-until (lambda () (= 1 (stat server :writing))))
                      "the answer does not wait for the client: ~S" (gallop:stats server))
                  (is (wait-until (lambda () (zerop (stat server :open))) :timeout 15)
                      "still open: ~S" (gallop:stats server))
                  (is (= 1 (stat server :write-timeouts)) "~S" (gallop:stats server))
                  (is (= 1 (stat server :slow-clients))))
        (usocket:socket-close socket)))))

(test pipelined-chunked-bodies-do-not-grow-the-input-buffer
  ;; 300 small chunked POSTs pipelined in a few writes, each gathered: the
  ;; heads move to the front of the 8 KiB input buffer as they come, so
  ;; that it does not grow with the octets the connection ever sent.  A
  ;; partial head at the end keeps the buffer, counted in :HEAD-BYTES.
  (with-gather-front-end (port server :native nil)
    (let* ((one (concatenate '(vector (unsigned-byte 8))
                             (octets (crlf "POST /gather-echo HTTP/1.1" "Host: x"
                                           "Transfer-Encoding: chunked"))
                             (chunked-octets (gather-octets 20) 7)))
           (all (apply #'concatenate '(vector (unsigned-byte 8))
                       (append (loop repeat 300 collect one)
                               (list (octets (format nil "GET /gather-ping HTTP/1.1~C~C"
                                                     #\Return #\Linefeed))))))
           (socket (connect port)))
      (unwind-protect
           (progn
             (loop for start from 0 below (length all) by 9000
                   do (send-octets socket all :start start :end (min (length all) (+ start 9000))))
             (let ((bad (loop repeat 300
                              count (let ((answer (read-wire-or-error socket :persistent t)))
                                      (not (and (wire-response-p answer)
                                                (equalp (gather-octets 20) (wire-body answer))))))))
               (is (zerop bad) "~D of 300 answers wrong" bad))
             (is (wait-until (lambda () (plusp (stat server :head-bytes)))))
             (is (= 8192 (stat server :head-bytes)) "the input buffer grew to ~D octets"
                 (stat server :head-bytes)))
        (usocket:socket-close socket)))))
