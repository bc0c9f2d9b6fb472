;;;; heads.lisp -- Hunchentoot on Gallop reads its requests from the core's
;;;; record and writes its response heads with Gallop's writer
;;;; (src/hunchentoot/heads.lisp).  The heads must be the bytes stock
;;;; Hunchentoot writes (but for Date), read strictly; the request a handler
;;;; sees must be the one the core parsed; and where Gallop differs on
;;;; purpose (header values on one line, method case, header names not
;;;; interned), the difference is pinned here.

(in-package #:gallop-tests)
(in-suite requests)

(hunchentoot:define-easy-handler (ht-wire-plain :uri "/wire/plain") (x)
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "plain ~A" x))

(hunchentoot:define-easy-handler (ht-wire-headers :uri "/wire/headers") ()
  (setf (hunchentoot:return-code*) 201
        (hunchentoot:content-type*) "application/json"
        (hunchentoot:header-out :x-number) 42
        (hunchentoot:header-out :x-symbol) 'some-symbol
        (hunchentoot:header-out :x-string) "a b;  c")
  (hunchentoot:set-cookie "session" :value "abc" :path "/" :http-only t)
  (hunchentoot:set-cookie "other" :value "x y")
  "{}")

(hunchentoot:define-easy-handler (ht-wire-redirect :uri "/wire/redirect") ()
  (hunchentoot:redirect "/wire/plain?x=moved"))

(hunchentoot:define-easy-handler (ht-wire-stream :uri "/wire/stream") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (let ((stream (hunchentoot:send-headers)))
    (write-sequence (octets "first,") stream)
    (force-output stream)
    (write-sequence (octets "second") stream)
    nil))

(hunchentoot:define-easy-handler (ht-wire-form :uri "/wire/form") (a b)
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "~A|~A|~A" (hunchentoot:request-method*) a b))

(defparameter *wire-requests*
  (list (crlf "GET /wire/plain?x=1 HTTP/1.1" "Host: h")
        (crlf "GET /wire/headers HTTP/1.1" "Host: h" "Cookie: a=b")
        (crlf "HEAD /wire/plain?x=2 HTTP/1.1" "Host: h")
        (crlf "GET /wire/no-such-page HTTP/1.1" "Host: h")
        (crlf "GET /wire/redirect HTTP/1.1" "Host: h")
        (crlf "GET /wire/stream HTTP/1.1" "Host: h")
        (crlf "GET /wire/plain HTTP/1.0" "Connection: keep-alive")
        (concatenate 'string
                     (crlf "POST /wire/form HTTP/1.1" "Host: h"
                           "Content-Type: application/x-www-form-urlencoded"
                           "Content-Length: 12")
                     "a=1&b=two%21")
        (crlf "GET /wire/plain?x=last HTTP/1.1" "Host: h" "Connection: close"))
  "The requests sent, in turn on one connection, to stock Hunchentoot and to
Gallop: every shape of head Hunchentoot writes (string and octet bodies,
HEAD, its own 404 page, a redirect, cookies, numbers and symbols as header
values, SEND-HEADERS streaming chunked, HTTP/1.0 keep-alive, a form post,
the closing answer).")

(defun head-without-date (response)
  "The head of RESPONSE (octets) as a string, its Date value blanked."
  (let ((head (latin1 (wire-head response))))
    (cl-ppcre:regex-replace "(?m)^Date: [^\\r]*\\r$" head "Date: -")))

(defun without-port (string)
  "STRING without the port number Hunchentoot's error pages name."
  (cl-ppcre:regex-replace-all "\\(port \\d+\\)" string "(port -)"))

(defun exchange-wire-requests (port)
  "Send *WIRE-REQUESTS* in turn on one connection to PORT; the responses,
read strictly."
  (let ((socket (connect port)))
    (unwind-protect
         (loop for (request . rest) on *wire-requests*
               collect (progn
                         (send socket request)
                         (read-wire socket :head-request (search "HEAD " request :end2 5)
                                           :close (null rest))))
      (usocket:socket-close socket))))

(test hunchentoot-heads-are-the-bytes-stock-writes
  ;; The same requests to stock Hunchentoot and to Gallop's easy-acceptor:
  ;; byte for byte the same heads (Date aside) and bodies.
  (let ((stock (with-server (server 'hunchentoot:easy-acceptor)
                 (exchange-wire-requests (port-of server))))
        (gallop (with-server (server 'gallop:easy-acceptor)
                  (exchange-wire-requests (port-of server)))))
    (is (= (length *wire-requests*) (length stock) (length gallop)))
    (loop for s in stock
          for g in gallop
          for request in *wire-requests*
          do (is (string= (head-without-date s) (head-without-date g))
                 "For ~S:~%stock:  ~S~%gallop: ~S" request (head-without-date s) (head-without-date g))
             (is (equal (without-port (wire-body-string s)) (without-port (wire-body-string g)))
                 "For ~S: bodies differ: ~S vs ~S" request (wire-body-string s) (wire-body-string g)))
    ;; and they are the answers meant, not just equal ones
    (destructuring-bind (plain headers head missing redirect stream http10 form last) gallop
      (is (equal "plain 1" (wire-body-string plain)))
      (is (= 201 (wire-status headers)))
      (is (equal "42" (wire-header headers "X-Number")))
      (is (equal "SOME-SYMBOL" (wire-header headers "X-Symbol")))
      (is (equal "a b;  c" (wire-header headers "X-String")))
      (is (equal '("other=x y" "session=abc; Path=/; HttpOnly") ; Hunchentoot's order
                 (wire-header-values headers "Set-Cookie")))
      (is (and (wire-flag-p head :no-body) (equal "7" (wire-header head "Content-Length"))))
      (is (= 404 (wire-status missing)))
      (is (and (= 302 (wire-status redirect))
               (search "/wire/plain?x=moved" (wire-header redirect "Location"))))
      (is (and (wire-flag-p stream :chunked) (equal "first,second" (wire-body-string stream))))
      (is (equal "Keep-Alive" (wire-header http10 "Connection")))
      (is (equal "POST|1|two!" (wire-body-string form)))
      (is (and (wire-flag-p last :eof) (equal "plain last" (wire-body-string last)))))))

(defun exchange-head-then-get (port)
  "HEAD /wire/stream and a GET pipelined behind it in one write to PORT: the
two responses, read strictly, the second the last on the connection."
  (let ((socket (connect port)))
    (unwind-protect
         (progn
           (send socket (concatenate 'string
                                     (crlf "HEAD /wire/stream HTTP/1.1" "Host: h")
                                     (crlf "GET /wire/plain?x=after HTTP/1.1" "Host: h"
                                           "Connection: close")))
           (list (read-wire-or-error socket :head-request t :persistent t)
                 (read-wire-or-error socket :close t)))
      (usocket:socket-close socket))))

(test hunchentoot-head-of-a-streamed-answer-keeps-the-connection
  ;; SEND-HEADERS answering HEAD: the head alone (stock Hunchentoot names
  ;; the chunked coding a GET would get, and sends no chunk), and the
  ;; request pipelined behind it is answered; the bytes stock writes.
  (let ((stock (with-server (server 'hunchentoot:easy-acceptor)
                 (exchange-head-then-get (port-of server))))
        (gallop (with-server (server 'gallop:easy-acceptor)
                  (exchange-head-then-get (port-of server)))))
    (if (notevery #'wire-response-p (append stock gallop))
        (fail "not two valid answers: stock ~A, gallop ~A" stock gallop)
        (destructuring-bind (head get) gallop
          (loop for s in stock
                for g in gallop
                do (is (string= (head-without-date s) (head-without-date g))
                       "stock:  ~S~%gallop: ~S" (head-without-date s) (head-without-date g))
                   (is (equal (wire-body-string s) (wire-body-string g))))
          (is (and (= 200 (wire-status head)) (wire-flag-p head :no-body)
                   (null (wire-header head "Connection")))
              "~A" (head-without-date head))
          (is (and (wire-flag-p get :eof) (equal "plain after" (wire-body-string get))))))))

(hunchentoot:define-easy-handler (ht-wire-odd-values :uri "/wire/odd-values") ()
  (setf (hunchentoot:content-type*) "text/plain"
        (hunchentoot:header-out :x-lines) (format nil "one~%two~%~%three~%")
        (hunchentoot:header-out :x-empty) ""
        (hunchentoot:header-out :x-cr) (format nil "a~Cb" #\Return)
        (hunchentoot:header-out :x-wide) (format nil "caf~C ~C" (code-char 233) (code-char 8364)))
  "ok")

(test hunchentoot-header-values-are-written-on-one-line
  ;; Stock Hunchentoot folds a value with newlines over several lines
  ;; (obs-fold, which RFC 9112 5.2 forbids in a response), writes an empty
  ;; value without its CRLF (the next header line joins it) and a CR as it
  ;; is.  Gallop writes what a client makes of the folding, on one line.
  (with-server (server 'gallop:easy-acceptor)
    (let ((socket (connect (port-of server))))
      (unwind-protect
           (progn
             (send socket (crlf "GET /wire/odd-values HTTP/1.1" "Host: h"))
             (let ((response (read-wire socket)))
               (is (equal "ok" (wire-body-string response)))
               (is (equal "one two three" (wire-header response "X-Lines")))
               (is (equal "" (wire-header response "X-Empty")))
               (is (equal "a b" (wire-header response "X-Cr")))
               (is (equal (format nil "caf~C ?" (code-char 233)) (wire-header response "X-Wide")))
               (is (search (format nil "~C~CX-Empty: ~C~C" #\Return #\Linefeed #\Return #\Linefeed)
                           (latin1 (wire-head response))))))
        (usocket:socket-close socket)))))

(defvar *wire-seen* nil
  "What /wire/seen saw of its request, for the test thread.")

(hunchentoot:define-easy-handler (ht-wire-seen :uri "/wire/seen") ()
  (setf *wire-seen*
        (list :method (hunchentoot:request-method*)
              :uri (hunchentoot:request-uri*)
              :protocol (hunchentoot:server-protocol*)
              :headers (mapcar (lambda (pair)
                                 (list (symbol-name (car pair))
                                       (and (symbol-package (car pair)) t)
                                       (cdr pair)))
                               (hunchentoot:headers-in*))
              :named (hunchentoot:header-in* :x-named-in-code)))
  (setf (hunchentoot:content-type*) "text/plain")
  "seen")

(defun wire-seen (port request)
  "Send REQUEST to PORT; what /wire/seen saw of it."
  (setf *wire-seen* nil)
  (let ((socket (connect port)))
    (unwind-protect
         (progn (send socket request)
                (is (equal "seen" (wire-body-string (read-wire socket))))
                *wire-seen*)
      (usocket:socket-close socket))))

(test hunchentoot-requests-come-from-the-core-record
  (with-server (server 'gallop:easy-acceptor)
    (let* ((unseen (format nil "X-Gallop-Unseen-~36R" (random (expt 36 12))))
           (seen (wire-seen (port-of server)
                            (crlf "GET /wire/seen?q=%41 HTTP/1.1" "Host: h"
                                  "X-A: 1" "x-a:  2  " "X-A: 3" (format nil "~A: v" unseen)
                                  "X-Named-In-Code: here" "X-Gallop-Empty:"))))
      (is (eq :get (getf seen :method)))
      (is (equal "/wire/seen?q=%41" (getf seen :uri)))
      (is (eq :http/1.1 (getf seen :protocol)))
      ;; chunga's reading: names upper-cased, a repeated name once, its
      ;; values joined by a comma, values trimmed, in order of the head
      (flet ((interned-p (name) (and (find-symbol name :keyword) t)))
        (is (equal `(("HOST" t "h") ("X-A" ,(interned-p "X-A") "1,2,3")
                     (,(string-upcase unseen) nil "v")
                     ("X-NAMED-IN-CODE" t "here") ("X-GALLOP-EMPTY" ,(interned-p "X-GALLOP-EMPTY") ""))
                   (getf seen :headers))))
      ;; a name no code mentions was not interned; one the code names is found
      (is (null (find-symbol (string-upcase unseen) :keyword)))
      (is (equal "here" (getf seen :named))))
    ;; Methods are case-sensitive: "get" is not GET (RFC 9110 9.1).
    (unless (gallop::hunchentoot-request-methods) ; 1.3.x refuses it first (501)
      (let ((seen (wire-seen (port-of server) (crlf "get /wire/seen HTTP/1.1" "Host: h"))))
        (is (equal "get" (symbol-name (getf seen :method))))
        (is (not (eq :get (getf seen :method))))))
    (let ((seen (wire-seen (port-of server) (crlf "GET /wire/seen HTTP/1.0"))))
      (is (eq :http/1.0 (getf seen :protocol)))
      (is (null (getf seen :headers))))))

(test hunchentoot-header-stream-still-gets-every-head-line
  ;; With HUNCHENTOOT:*HEADER-STREAM* set, Hunchentoot's own reading and
  ;; writing run (they copy each head line there): the answer is the same.
  (let ((copy (make-string-output-stream)))
    (with-server (server 'gallop:easy-acceptor)
      (let ((response (with-globals ((hunchentoot:*header-stream* copy))
                        (let ((socket (connect (port-of server))))
                          (unwind-protect
                               (progn (send socket (crlf "GET /wire/plain?x=copied HTTP/1.1"
                                                         "Host: h" "Connection: close"))
                                      (read-wire socket :close t))
                            (usocket:socket-close socket))))))
        (is (equal "plain copied" (wire-body-string response)))
        (let ((text (get-output-stream-string copy)))
          (is (search "GET /wire/plain?x=copied HTTP/1.1" text))
          (is (search "HTTP/1.1 200 OK" text))
          (is (search "Content-Length: 12" text)))))))
